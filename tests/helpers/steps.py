"""Step inputs of the layer-level tests: packed prompts, random prompt sets, the steps of a DP schedule, and the
forward context of a step without DP (for `ple_step.pack`)."""

import torch

from helpers.configs import EOS
from qwen4_exp_hcu.ple.batch import PLEBatch


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


def schedule_step(cfg, schedules, dp, step, num_layers, device="cpu") -> tuple[PLEBatch, list[torch.Tensor]]:
    """Step `step` of DP replica `dp`, whose requests are `schedules[dp][step]` as (slot, tokens,
    has_initial_state): its batch (max_tokens not set) and `num_layers` hidden states. Drawn on the CPU from
    a seed of (dp, step), so every rank and device of a run gets the same values."""
    reqs = schedules[dp][step]
    g = torch.Generator().manual_seed(100 * dp + step)
    T = sum(n for _, n, _ in reqs)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    if (dp, step) == (0, 0):
        ids[3] = EOS  # an n-gram boundary inside a prompt
    C = cfg.hidden_size * cfg.hc_count
    hs = [torch.randn(T, C, generator=g).to(device) for _ in range(num_layers)]
    batch = PLEBatch.from_lengths(ids.to(device), [n for _, n, _ in reqs], [s for s, _, _ in reqs], [h for _, _, h in reqs])
    return batch, hs


def patch_forward_context():
    """`ple_step.pack` asks the forward context for DP metadata; a step without DP has none."""
    from types import SimpleNamespace
    from unittest import mock

    return mock.patch("qwen4_exp_hcu.model.ple_step.get_forward_context", lambda: SimpleNamespace(dp_metadata=None))
