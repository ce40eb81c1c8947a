"""The Triton n-gram hash kernel vs its torch reference (`ple.hashing.ngram_ids_reference`)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.configs import EOS, tiny_text_config
from helpers.steps import pack, random_prompts
from qwen4_exp_hcu.kernels.ngram_hash import ngram_hash
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids_reference


@settings(max_examples=25, deadline=None)
@given(
    ngram_size=st.integers(2, 5),
    per=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
    n_req=st.integers(1, 6),
    block_t=st.sampled_from([16, 64]),
)
def test_triton_hash_matches_reference(ngram_size, per, seed, n_req, block_t):
    cfg = tiny_text_config(ngram_size=ngram_size, heads_per_ngram=per)
    spec = NgramHashSpec.from_config(cfg, 1)
    gen = torch.Generator().manual_seed(seed)
    prompts = random_prompts(gen, n_req, 40)
    ids, qsl = pack(prompts)
    ctx = torch.randint(0, 97, (n_req, ngram_size - 1), generator=gen)
    ctx[torch.rand(ctx.shape, generator=gen) < 0.3] = EOS
    ref = ngram_ids_reference(spec, ids, qsl, ctx)
    assert torch.equal(ngram_hash(spec, ids, qsl, ctx, block_t=block_t), ref)
    assert ref.min() >= 0 and ref.max() < spec.rows
