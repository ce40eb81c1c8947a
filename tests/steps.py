"""Step inputs shared by the layer-level tests: packed prompts and random prompt sets."""

import torch

from ple_configs import EOS


def pack(prompts):
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    qsl = torch.tensor([0] + [len(p) for p in prompts]).cumsum(0).to(torch.int32)
    return ids, qsl


def random_prompts(gen, n, max_len, vocab=97, eos_rate=0.15):
    lens = torch.randint(1, max_len + 1, (n,), generator=gen).tolist()
    prompts = []
    for length in lens:
        p = torch.randint(0, vocab, (length,), generator=gen)
        p[torch.rand(length, generator=gen) < eos_rate] = EOS
        prompts.append(p.tolist())
    return prompts
