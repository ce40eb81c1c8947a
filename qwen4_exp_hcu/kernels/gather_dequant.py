"""Fused gather + dequantize over a PLE table shard, device-resident or pinned host (UVA).

One pass: each (token, head) reads its row (and scales) straight from wherever the table lives,
dequantizes in fp32 and writes bf16 into the output slice ``out[t, h*d:(h+1)*d]``. The row format is a
compile-time switch: BF16, INT8 + per-row bf16 scale, FP8 e4m3 + per-table scale (bf16-valued, so the fp32
product equals upstream's bf16 one), NVFP4 (packed
e2m1 + e4m3 block scales + fp32 global scale; `qwen4_exp_hcu.ple.formats.rows`). Row ids outside the owned
range ``[start, start + n_rows)`` write zeros (the ETP combine sums the shards), and masked loads
guarantee nothing outside the table is ever read. Float8 bytes are decoded with integer ops, so the
interpreter (CPU) and the GPU agree bit for bit. The format follows the storage dtype.

Host tables are bound by address translation of random rows, not by PCIe bandwidth, so `sort` visits
the rows in id order (neighbouring programs touch neighbouring pages; the permutation scatters results
back). An optional GPU cache of hot rows (`cache_map[row] -> slot`, -1 = miss; or, `cache_by_pair`, one slot per
(token, head) when the ids are not table rows) is checked in the same kernel; hits never touch host memory.
`gather_dequant_reference` is the same in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qwen4_exp_hcu.ple.formats.rows import FORMATS, table_format


@triton.jit
def _to_bf16_rtne(x):
    """fp32 -> bf16, round to nearest even, spelled out in integer ops: Triton's interpreter truncates
    on a plain cast, so this keeps CPU (TRITON_INTERPRET=1) and GPU results bit-identical. Finite x only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e4m3_to_f32(byte):
    """float8 e4m3 (fn) byte -> fp32, exactly: normals rebuilt as fp32 bits, subnormals m * 2^-9; the sign
    goes in as a bit (a float negation may lose the sign of zero in compiled code)."""
    b = byte.to(tl.uint32)
    e, m = (b >> 3) & 0xF, b & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    return (tl.where(e == 0, sub, normal) | ((b >> 7) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(code):
    """4-bit e2m1 code -> fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (-0.0 included), as fp32 bits."""
    c = code.to(tl.uint32)
    e, m = (c >> 1) & 3, c & 1
    normal = ((e + 126) << 23) | (m << 22)
    mag = tl.where(e == 0, m * 0x3F000000, normal)  # 0x3F000000 = 0.5
    return (mag | ((c >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _gather_dequant_kernel(
    ids_ptr, perm_ptr, w_ptr, s_ptr, g_ptr, map_ptr, cw_ptr, cs_ptr, out_ptr,
    n_pairs, start, n_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    FMT: tl.constexpr, HAS_PERM: tl.constexpr, HAS_CACHE: tl.constexpr, CACHE_BY_PAIR: tl.constexpr,
):
    """FMT (`TableFormat.kernel`): 0 bf16, 1 int8 + row scale, 2 fp8 (bytes) + tensor scale, 3 nvfp4 (packed
    bytes, block-scale bytes, global scale). The hot-row cache serves formats 0 and 1."""
    cols = tl.arange(0, BLOCK_D)
    cmask = cols[None, :] < D
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < n_pairs
    row = tl.load(ids_ptr + p, mask=pmask, other=-1) - start
    pair = tl.load(perm_ptr + p, mask=pmask, other=0) if HAS_PERM else p  # flat (token, head) index
    owned = pmask & (row >= 0) & (row < n_rows)
    row = tl.where(owned, row, 0)
    lmask = owned[:, None] & cmask
    if FMT == 3:
        packed = tl.load(w_ptr + row[:, None] * (D // 2) + cols[None, :] // 2, mask=lmask, other=0)
        code = (packed.to(tl.uint32) >> ((cols[None, :] % 2) * 4).to(tl.uint32)) & 0xF
        block = tl.load(s_ptr + row[:, None] * (D // 16) + cols[None, :] // 16, mask=lmask, other=0)
        w = _e2m1_to_f32(code) * _e4m3_to_f32(block)
        w = w * tl.load(g_ptr).to(tl.float32)
    elif FMT == 2:
        w = _e4m3_to_f32(tl.load(w_ptr + row[:, None] * D + cols[None, :], mask=lmask, other=0))
        w = w * tl.load(s_ptr).to(tl.float32)
    else:
        miss = owned
        if HAS_CACHE:
            slot = tl.load(map_ptr + (pair if CACHE_BY_PAIR else row), mask=owned, other=-1).to(tl.int64)
            hit = slot >= 0
            miss = owned & ~hit
            slot = tl.where(hit, slot, 0)
            w = tl.load(cw_ptr + slot[:, None] * D + cols[None, :], mask=hit[:, None] & cmask, other=0)
            w += tl.load(w_ptr + row[:, None] * D + cols[None, :], mask=miss[:, None] & cmask, other=0)
        else:
            w = tl.load(w_ptr + row[:, None] * D + cols[None, :], mask=lmask, other=0)
        w = w.to(tl.float32)
        if FMT == 1:
            s = tl.load(s_ptr + row, mask=miss, other=0).to(tl.float32)
            if HAS_CACHE:
                s += tl.load(cs_ptr + slot, mask=hit, other=0).to(tl.float32)
            w = w * s[:, None]
    w = tl.where(lmask, w, 0.0)  # rows another rank owns: exact zeros
    # out is [T, H*d] contiguous, so pair p's slice starts at p*d
    tl.store(out_ptr + pair[:, None] * D + cols[None, :], _to_bf16_rtne(w), mask=pmask[:, None] & cmask)


def gather_dequant(
    ids, weight, scale, start: int, out, *, global_scale=None, block_p: int = 16, num_warps: int = 4,
    sort: bool = False, cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    cache_by_pair: bool = False,
) -> torch.Tensor:
    """ids [T, H] int64 -> out [T, H*d] bf16. The format follows the storage dtypes (`ple.formats`):
    bf16 weight (scale None); int8 weight + [n, 1] bf16 scale; float8_e4m3fn weight + fp32 scalar
    scale; uint8 packed weight [n, d/2] + e4m3 [n, d/16] scale + fp32 `global_scale`.
    `cache` = (map [n_rows] int32 row -> slot or -1, cached rows, their scales): BF16/INT8 only; with
    `cache_by_pair` the map is [T*H], one slot per (token, head), and a hit's id may be any owned row."""
    fmt = FORMATS[table_format(weight, scale)]
    if cache is not None and not fmt.hot_rows:
        raise ValueError(f"the hot-row cache serves BF16 and INT8 PLE tables, not {weight.dtype}.")
    if (global_scale is not None) != (fmt.row_scale is not None and fmt.table_scale is not None):
        raise ValueError("global_scale is the NVFP4 tensor scale: needed by NVFP4 tables, taken by no other.")
    n_pairs = ids.numel()
    if n_pairs:
        d = weight.shape[1] * fmt.pack
        block = fmt.row_scale.block if fmt.row_scale else None
        if block and d % block:
            raise ValueError(f"{fmt.name.upper()} rows must hold a multiple of {block} values, got {d}.")
        flat, perm = ids.reshape(-1), None
        if sort:
            flat, perm = torch.sort(flat)
        as_bytes = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
        w, s = as_bytes(weight), as_bytes(scale) if scale is not None else weight
        cmap, cw, cs = cache if cache is not None else (flat, w, s)
        _gather_dequant_kernel[(triton.cdiv(n_pairs, block_p),)](
            flat, perm if sort else flat, w, s, global_scale if global_scale is not None else s,
            cmap, cw, cs if cs is not None else cw, out,
            n_pairs, start, weight.shape[0],
            D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_P=block_p,
            FMT=fmt.kernel, HAS_PERM=sort, HAS_CACHE=cache is not None, CACHE_BY_PAIR=cache_by_pair, num_warps=num_warps,
        )
    return out


def gather_dequant_reference(ids, weight, scale, start: int, global_scale=None) -> torch.Tensor:
    """`gather_dequant` in torch, returning [T, H*d] bf16: each format's `TableFormat.dequantize`."""
    fmt = FORMATS[table_format(weight, scale)]
    n, d = weight.shape[0], weight.shape[1] * fmt.pack
    local = ids.long() - start
    owned = (local >= 0) & (local < n)
    if n == 0:
        return torch.zeros(*ids.shape[:-1], ids.shape[-1] * d, dtype=torch.bfloat16, device=ids.device)
    rows = local.clamp(0, n - 1).reshape(-1)
    # the kernel's convention: `scale` holds the row scales, or the table scale of a format without them
    row_scale, table_scale = (scale[rows], global_scale) if fmt.row_scale else (None, scale)
    vals = fmt.dequantize(weight[rows], row_scale, table_scale).view(*local.shape, d)
    vals = torch.where(owned[..., None], vals, torch.zeros((), dtype=torch.bfloat16, device=vals.device))
    return vals.flatten(-2)
