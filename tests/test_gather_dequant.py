"""The fused gather + dequant Triton kernel vs its torch reference (`ple.table.gather_dequant_reference`)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant
from qwen4_exp_hcu.ple.int8 import quantize_rows
from qwen4_exp_hcu.ple.table import gather_dequant_reference


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 300),
    d=st.sampled_from([1, 8, 16, 24, 128]),
    t=st.integers(0, 40),
    heads=st.integers(1, 6),
    quantized=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    block_p=st.sampled_from([4, 16]),
    sort=st.booleans(),
    cached=st.booleans(),
)
def test_fused_kernel_matches_reference(rows, d, t, heads, quantized, seed, block_p, sort, cached):
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, rows, (1,), generator=g))
    end = int(torch.randint(start, rows + 1, (1,), generator=g))
    w = torch.randn(end - start, d, generator=g).to(torch.bfloat16)
    scale = None
    if quantized:
        w, scale = quantize_rows(w)
    cache = None
    if cached:  # a random half of the owned rows lives in the "GPU" cache, in shuffled slots
        hot = torch.randperm(end - start, generator=g)[: (end - start) // 2]
        cmap = torch.full((end - start,), -1, dtype=torch.int32)
        cmap[hot] = torch.arange(len(hot), dtype=torch.int32)
        cache = (cmap, w[hot].clone(), None if scale is None else scale[hot].clone())
    ids = torch.randint(-3, rows + 3, (t, heads), generator=g)  # includes ids no shard owns
    out = torch.full((t, heads * d), float("nan"), dtype=torch.bfloat16)
    gather_dequant(ids, w, scale, start, out, block_p=block_p, sort=sort, cache=cache)
    assert torch.equal(out, gather_dequant_reference(ids, w, scale, start))
