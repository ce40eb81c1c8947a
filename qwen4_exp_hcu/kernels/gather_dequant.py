"""Fused gather + dequantize over a PLE table shard, device-resident or pinned host (UVA).

One pass: each (token, head) reads its row (and scales) straight from wherever the table lives,
dequantizes in fp32 and writes bf16 into the output slice ``out[t, h*d:(h+1)*d]``. The row layout (`kind`) is a
compile-time switch, passed by the caller (a format's `TableFormat.kernel_args`): `BF16` rows, `INT8` rows times
a per-row scale, `FP8` e4m3 rows times one table scale (bf16-valued, so the fp32 product equals upstream's bf16
one), `NVFP4` e2m1 values packed two per byte times e4m3 block scales (one per `block` values) times one fp32
table scale. Row ids outside the owned range ``[start, start + n_rows)`` write zeros (the ETP combine sums the
shards), and masked loads guarantee nothing outside the table is ever read. Float8 bytes are decoded with
integer ops, so the interpreter (CPU) and the GPU agree bit for bit.

Host tables are bound by address translation of random rows, not by PCIe bandwidth, so `sort` visits
the rows in id order (neighbouring programs touch neighbouring pages; the permutation scatters results
back). An optional GPU cache of hot rows (`cache_map[row] -> slot`, -1 = miss; or, `cache_by_pair`, one slot per
(token, head) when the ids are not table rows) is checked in the same kernel; hits never touch host memory.
`gather_dequant_reference` is the same in torch: one fp32 product of a row's values and its scales, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BF16, INT8, FP8, NVFP4 = range(4)  # the row layouts `kind` selects
CACHED_KINDS = (BF16, INT8)  # whole rows with at most one scale each: what the hot-row cache path reads
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code & 7 (sign in bit 3)


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
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    FMT: tl.constexpr, HAS_PERM: tl.constexpr, HAS_CACHE: tl.constexpr, CACHE_BY_PAIR: tl.constexpr,
):
    """FMT (`kind`): 0 bf16, 1 int8 + row scale, 2 fp8 (bytes) + tensor scale, 3 nvfp4 (packed bytes, one
    block-scale byte per SCALE_BLOCK values, global scale). The hot-row cache is read by kinds 0 and 1."""
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
        block = tl.load(s_ptr + row[:, None] * (D // SCALE_BLOCK) + cols[None, :] // SCALE_BLOCK, mask=lmask, other=0)
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
    ids, weight, scale, start: int, out, *, kind: int, block: int | None = None, global_scale=None, block_p: int = 16,
    num_warps: int = 4, sort: bool = False, cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    cache_by_pair: bool = False,
) -> torch.Tensor:
    """ids [T, H] int64 -> out [T, H*d] bf16, rows of layout `kind`: bf16 weight (scale None); int8 weight + [n, 1]
    scale; float8_e4m3fn weight + fp32 scalar scale; uint8 packed weight [n, d/2] + e4m3 [n, d/block] scale + fp32
    `global_scale`. `cache` = (map [n_rows] int32 row -> slot or -1, cached rows, their scales), for `CACHED_KINDS`;
    with `cache_by_pair` the map is [T*H], one slot per (token, head), and a hit's id may be any owned row."""
    _check(kind, scale, block, global_scale)
    if cache is not None and kind not in CACHED_KINDS:
        raise ValueError(f"gather_dequant: the hot-row cache is read by kinds {CACHED_KINDS}, not {kind}.")
    n_pairs = ids.numel()
    if n_pairs:
        d = _width(kind, weight)
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
            D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_P=block_p, SCALE_BLOCK=block or 1,
            FMT=kind, HAS_PERM=sort, HAS_CACHE=cache is not None, CACHE_BY_PAIR=cache_by_pair, num_warps=num_warps,
        )
    return out


def _check(kind: int, scale, block: int | None, global_scale) -> None:
    """What each layout reads beside its rows: a scale (all but BF16); NVFP4 its block size and a global scale."""
    if kind not in (BF16, INT8, FP8, NVFP4):
        raise ValueError(f"gather_dequant: kind {kind} is none of the row layouts (BF16, INT8, FP8, NVFP4 = 0..3).")
    if (scale is None) != (kind == BF16):
        raise ValueError(f"gather_dequant: kind {kind} rows {'take no' if kind == BF16 else 'need a'} scale.")
    if (global_scale is not None) != (kind == NVFP4) or (kind == NVFP4 and not block):
        raise ValueError("gather_dequant: NVFP4 rows need `block` and `global_scale`; no other kind takes a global scale.")


def _width(kind: int, weight: torch.Tensor) -> int:
    """Values per row: NVFP4 packs two in each stored byte."""
    return weight.shape[1] * (2 if kind == NVFP4 else 1)


def gather_dequant_reference(ids, weight, scale, start: int, global_scale=None, *, kind: int, block: int | None = None):
    """`gather_dequant` in torch, returning [T, H*d] bf16."""
    _check(kind, scale, block, global_scale)
    n, d = weight.shape[0], _width(kind, weight)
    local = ids.long() - start
    owned = (local >= 0) & (local < n)
    if n == 0:
        return torch.zeros(*ids.shape[:-1], ids.shape[-1] * d, dtype=torch.bfloat16, device=ids.device)
    rows = local.clamp(0, n - 1).reshape(-1)
    # `scale` holds the row scales (INT8, NVFP4), or the table scale of a layout without them (FP8)
    row_scale, table_scale = (scale[rows], global_scale) if kind in (INT8, NVFP4) else (None, scale)
    vals = _dequantize(kind, weight[rows], row_scale, table_scale, block).view(*local.shape, d)
    vals = torch.where(owned[..., None], vals, torch.zeros((), dtype=torch.bfloat16, device=vals.device))
    return vals.flatten(-2)


def _dequantize(kind: int, rows: torch.Tensor, row_scale, table_scale, block: int | None) -> torch.Tensor:
    """[n, stored] rows -> [n, d] bf16: values times their row or block scales, times the table scale, in fp32."""
    if kind == NVFP4:
        codes = torch.stack([rows & 0xF, rows >> 4], dim=-1).flatten(-2).long()  # low nibble first
        values = torch.tensor(_E2M1, device=rows.device)[codes & 7]
        w = torch.where(codes >= 8, -values, values) * row_scale.float().repeat_interleave(block, dim=-1)
    else:
        w = rows.float() if row_scale is None else rows.float() * row_scale.float()
    if table_scale is not None:
        w = w * table_scale.float().reshape(())
    return w.to(torch.bfloat16)
