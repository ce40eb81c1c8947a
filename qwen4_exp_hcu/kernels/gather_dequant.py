"""Fused gather + dequantize over a PLE table shard, device-resident or pinned host (UVA).

One pass: each (token, head) reads its int8 row and bf16 scale straight from wherever the table
lives, multiplies in fp32 and writes bf16 into the output slice ``out[t, h*d:(h+1)*d]``. Row ids
outside the owned range ``[start, start + n_rows)`` write zeros (the ETP combine sums the shards),
and masked loads guarantee nothing outside the table is ever read.

Host tables are bound by address translation of random rows, not by PCIe bandwidth, so `sort` visits
the rows in id order (neighbouring programs touch neighbouring pages; the permutation scatters results
back). An optional GPU cache of hot rows (`cache_map[row] -> slot`, -1 = miss) is checked in the same
kernel; hits never touch host memory.
Reference: `qwen4_exp_hcu.ple.table.gather_dequant_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _to_bf16_rtne(x):
    """fp32 -> bf16, round to nearest even, spelled out in integer ops: Triton's interpreter truncates
    on a plain cast, so this keeps CPU (TRITON_INTERPRET=1) and GPU results bit-identical. Finite x only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _gather_dequant_kernel(
    ids_ptr, perm_ptr, w_ptr, s_ptr, map_ptr, cw_ptr, cs_ptr, out_ptr,
    n_pairs, start, n_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_PERM: tl.constexpr, HAS_CACHE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)
    cmask = cols[None, :] < D
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < n_pairs
    row = tl.load(ids_ptr + p, mask=pmask, other=-1) - start
    pair = tl.load(perm_ptr + p, mask=pmask, other=0) if HAS_PERM else p  # flat (token, head) index
    owned = pmask & (row >= 0) & (row < n_rows)
    row = tl.where(owned, row, 0)
    miss = owned
    if HAS_CACHE:
        slot = tl.load(map_ptr + row, mask=owned, other=-1).to(tl.int64)
        hit = slot >= 0
        miss = owned & ~hit
        slot = tl.where(hit, slot, 0)
        w = tl.load(cw_ptr + slot[:, None] * D + cols[None, :], mask=hit[:, None] & cmask, other=0)
        w += tl.load(w_ptr + row[:, None] * D + cols[None, :], mask=miss[:, None] & cmask, other=0)
    else:
        w = tl.load(w_ptr + row[:, None] * D + cols[None, :], mask=owned[:, None] & cmask, other=0)
    w = w.to(tl.float32)
    if HAS_SCALE:
        s = tl.load(s_ptr + row, mask=miss, other=0).to(tl.float32)
        if HAS_CACHE:
            s += tl.load(cs_ptr + slot, mask=hit, other=0).to(tl.float32)
        w = w * s[:, None]
    # out is [T, H*d] contiguous, so pair p's slice starts at p*d
    tl.store(out_ptr + pair[:, None] * D + cols[None, :], _to_bf16_rtne(w), mask=pmask[:, None] & cmask)


def gather_dequant(
    ids, weight, scale, start: int, out, *, block_p: int = 16, num_warps: int = 4, sort: bool = False,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """ids [T, H] int64; weight [n_rows, d] int8 (or bf16 with scale=None); out [T, H*d] bf16.
    `cache` = (map [n_rows] int32 row -> slot or -1, cached rows, their scales)."""
    n_pairs = ids.numel()
    if n_pairs:
        d = weight.shape[1]
        flat, perm = ids.reshape(-1), None
        if sort:
            flat, perm = torch.sort(flat)
        cmap, cw, cs = cache if cache is not None else (flat, weight, scale)
        _gather_dequant_kernel[(triton.cdiv(n_pairs, block_p),)](
            flat, perm if sort else flat, weight, scale if scale is not None else weight,
            cmap, cw, cs if cs is not None else cw, out,
            n_pairs, start, weight.shape[0],
            D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_P=block_p,
            HAS_SCALE=scale is not None, HAS_PERM=sort, HAS_CACHE=cache is not None, num_warps=num_warps,
        )
    return out
