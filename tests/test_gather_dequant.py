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


def _e4m3_bytes(shape, g, positive=False):
    """Random finite float8 e4m3 values (every byte but the two NaNs), as float8 tensors."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # 0x7F / 0xFF are NaN
    if positive:
        b = b & 0x7F
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 200),
    blocks=st.integers(1, 4),
    t=st.integers(0, 30),
    heads=st.integers(1, 4),
    nvfp4=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    block_p=st.sampled_from([4, 16]),
    sort=st.booleans(),
)
def test_fp8_and_nvfp4_kernels_match_reference(rows, blocks, t, heads, nvfp4, seed, block_p, sort):
    """Every finite e4m3 byte and every e2m1 code, any scales: the kernel equals the reference bit for bit."""
    g = torch.Generator().manual_seed(seed)
    d = 16 * blocks
    start = int(torch.randint(0, rows, (1,), generator=g))
    n = int(torch.randint(0, rows - start + 1, (1,), generator=g))
    global_scale = None
    if nvfp4:
        w = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        scale = _e4m3_bytes((n, d // 16), g, positive=True)
        global_scale = torch.rand(1, generator=g) * 2 + 1e-3
    else:
        w, scale = _e4m3_bytes((n, d), g), torch.rand(1, generator=g) * 4 + 1e-3
    ids = torch.randint(start - 3, start + n + 3, (t, heads), generator=g)
    out = torch.full((t, heads * d), float("nan"), dtype=torch.bfloat16)
    gather_dequant(ids, w, scale, start, out, global_scale=global_scale, block_p=block_p, sort=sort)
    assert torch.equal(out, gather_dequant_reference(ids, w, scale, start, global_scale))
