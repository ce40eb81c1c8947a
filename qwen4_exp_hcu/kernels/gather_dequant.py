"""Fused gather + dequantize over a PLE table shard, device-resident or pinned host (UVA).

One pass: each (token, head) reads its int8 row and bf16 scale straight from wherever the table
lives, multiplies in fp32 and writes bf16 into the output slice ``out[t, h*d:(h+1)*d]``. Row ids
outside the owned range ``[start, start + n_rows)`` write zeros (the ETP combine sums the shards),
and masked loads guarantee nothing outside the table is ever read.
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
    ids_ptr, perm_ptr, w_ptr, s_ptr, out_ptr,
    n_pairs, start, n_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_PERM: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < n_pairs
    row = tl.load(ids_ptr + p, mask=pmask, other=-1) - start
    # sorted mode: ids come in row order (neighbouring programs touch neighbouring host pages),
    # perm[p] says which flat (token, head) pair each one belongs to
    pair = tl.load(perm_ptr + p, mask=pmask, other=0) if HAS_PERM else p
    owned = pmask & (row >= 0) & (row < n_rows)
    row = tl.where(owned, row, 0)
    cols = tl.arange(0, BLOCK_D)
    m = owned[:, None] & (cols[None, :] < D)
    w = tl.load(w_ptr + row[:, None] * D + cols[None, :], mask=m, other=0).to(tl.float32)
    if HAS_SCALE:
        w = w * tl.load(s_ptr + row, mask=owned, other=0).to(tl.float32)[:, None]
    # out is [T, H*d] contiguous, so pair p's slice starts at p*d
    tl.store(out_ptr + pair[:, None] * D + cols[None, :], _to_bf16_rtne(w), mask=pmask[:, None] & (cols[None, :] < D))


def gather_dequant(
    ids, weight, scale, start: int, out, block_p: int = 16, num_warps: int = 4, sort: bool = False
) -> torch.Tensor:
    """ids [T, H] int64; weight [n_rows, d] int8 (or bf16 with scale=None); out [T, H*d] bf16.
    `sort` visits the rows in id order (better locality for host tables; costs a sort)."""
    n_pairs = ids.numel()
    if n_pairs:
        d = weight.shape[1]
        flat, perm = ids.reshape(-1), None
        if sort:
            flat, perm = torch.sort(flat)
        _gather_dequant_kernel[(triton.cdiv(n_pairs, block_p),)](
            flat, perm if sort else flat, weight, scale if scale is not None else weight, out,
            n_pairs, start, weight.shape[0],
            D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_P=block_p, HAS_SCALE=scale is not None,
            HAS_PERM=sort, num_warps=num_warps,
        )
    return out
