"""The fused gather + dequant Triton kernel vs its torch reference (`kernels.gather_dequant_reference`),
for every row format: BF16, INT8 (+ the hot-row cache, its map by row or by (token, head)), FP8, NVFP4."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant, gather_dequant_reference
from qwen4_exp_hcu.ple.formats.int8 import quantize_rows
from qwen4_exp_hcu.ple.formats.rows import FORMATS


def _e4m3(shape, g, positive=False):
    """Random finite float8 e4m3 values (every byte but the two NaNs)."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # 0x7F / 0xFF are NaN
    return (b & 0x7F if positive else b).to(torch.uint8).view(torch.float8_e4m3fn)


def random_table(fmt, n, d, g):
    """(weight, scale, global_scale) of an n-row table of width d in `fmt`."""
    if fmt == "nvfp4":
        packed = torch.randint(0, 256, (n, d // 2), generator=g, dtype=torch.int32).to(torch.uint8)
        return packed, _e4m3((n, d // 16), g, positive=True), torch.rand(1, generator=g) * 2 + 1e-3
    if fmt == "fp8":
        # a bf16-valued fp32 scale, as PLETable.set_table_scale stores it (upstream's bf16 arithmetic)
        return _e4m3((n, d), g), (torch.rand(1, generator=g) * 4 + 1e-3).bfloat16().float(), None
    w = torch.randn(n, d, generator=g).to(torch.bfloat16)
    return (*quantize_rows(w), None) if fmt == "int8" else (w, None, None)


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(["bf16", "int8", "fp8", "nvfp4"]),
    rows=st.integers(1, 300),
    d=st.sampled_from([1, 8, 16, 24, 128]),
    t=st.integers(0, 40),
    heads=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
    block_p=st.sampled_from([1, 4, 16]),
    sort=st.booleans(),
    cached=st.booleans(),
    by_pair=st.booleans(),
)
def test_fused_kernel_matches_reference(fmt, rows, d, t, heads, seed, block_p, sort, cached, by_pair):
    """Random owned range, ids inside and outside it, every finite e4m3 byte and e2m1 code: bit-exact. With the
    cache mapped by (token, head) (the file tier's staged ids), a hit's id is some other owned row, which the
    kernel must not read."""
    g = torch.Generator().manual_seed(seed)
    d = 16 * max(1, d // 16) if fmt == "nvfp4" else d  # NVFP4 rows are whole 16-value blocks
    start = int(torch.randint(0, rows, (1,), generator=g))
    end = int(torch.randint(start, rows + 1, (1,), generator=g))
    w, scale, global_scale = random_table(fmt, end - start, d, g)
    cache = None
    if cached and fmt in ("bf16", "int8"):  # a random half of the owned rows in the "GPU" cache, shuffled slots
        hot = torch.randperm(end - start, generator=g)[: (end - start) // 2]
        cmap = torch.full((end - start,), -1, dtype=torch.int32)
        cmap[hot] = torch.arange(len(hot), dtype=torch.int32)
        cache = (cmap, w[hot].clone(), None if scale is None else scale[hot].clone())
    ids = torch.randint(-3, rows + 3, (t, heads), generator=g)  # includes ids no shard owns
    gathered, by_pair = ids, by_pair and cache is not None
    if by_pair:
        local = ids.flatten() - start
        owned = (local >= 0) & (local < end - start)
        slots = torch.full(local.shape, -1, dtype=torch.int32)
        slots[owned] = cache[0][local[owned]]
        cache = (slots, *cache[1:])
        elsewhere = start + torch.randint(0, max(end - start, 1), ids.shape, generator=g)
        gathered = torch.where(slots.view(ids.shape) >= 0, elsewhere, ids)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU
    on = lambda x: None if x is None else tuple(map(on, x)) if isinstance(x, tuple) else x.to(dev)  # noqa: E731
    out = torch.full((t, heads * d), float("nan"), dtype=torch.bfloat16, device=dev)
    layout = FORMATS[fmt].kernel_args  # what `PLETable` passes
    gather_dequant(on(gathered), on(w), on(scale), start, out, global_scale=on(global_scale), block_p=block_p,
                   sort=sort, cache=on(cache), cache_by_pair=by_pair, **layout)  # fmt: skip
    assert torch.equal(out.cpu(), gather_dequant_reference(ids, w, scale, start, global_scale, **layout))


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["bf16", "int8", "fp8", "nvfp4"]), rows=st.integers(1, 50), d=st.sampled_from([16, 48]),
       seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_the_reference_computes_each_formats_arithmetic(fmt, rows, d, seed):
    """The kernel's reference, read by a format's `kernel_args`, equals the format's own `dequantize` (upstream's
    arithmetic, the quantizer's), at the table scales a `PLETable` stores (FP8's bf16-valued)."""
    w, scale, global_scale = random_table(fmt, rows, d, torch.Generator().manual_seed(seed))
    f = FORMATS[fmt]
    got = gather_dequant_reference(torch.arange(rows).view(-1, 1), w, scale, 0, global_scale, **f.kernel_args)
    row_scale, table_scale = (scale, global_scale) if f.row_scale else (None, scale)
    assert torch.equal(got, f.dequantize(w, row_scale, table_scale))
