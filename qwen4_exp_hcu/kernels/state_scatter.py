"""Write per-request state rows back into their cache slots, skipping padding requests.

`dst[slot_ids[b]] = src[b]` for every b whose slot is in ``[0, S)``; padding requests (slot < 0) write
nothing, so a real request in slot 0 can never be overwritten by a padding row (no duplicate
indices, no host sync: usable inside a CUDA graph). Reference: `scatter_rows_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scatter_rows_kernel(dst_ptr, src_ptr, slot_ptr, S, row_len, dst_stride, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if (slot >= 0) & (slot < S):
        for off in range(0, row_len, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < row_len
            tl.store(dst_ptr + slot * dst_stride + cols, tl.load(src_ptr + b * row_len + cols, mask=m), mask=m)


def scatter_rows_reference(dst: torch.Tensor, slot_ids: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    keep = (slot_ids >= 0) & (slot_ids < dst.shape[0])
    dst[slot_ids[keep].long()] = src[keep].to(dst.dtype)
    return dst


def scatter_rows(dst: torch.Tensor, slot_ids: torch.Tensor, src: torch.Tensor, block: int = 1024) -> torch.Tensor:
    if src.shape[0]:
        src = src.to(dst.dtype).contiguous()
        if not dst[0].is_contiguous():
            raise ValueError("state cache rows must be contiguous within a slot.")
        _scatter_rows_kernel[(src.shape[0],)](
            dst, src, slot_ids, dst.shape[0], src[0].numel(), dst.stride(0), BLOCK=block
        )
    return dst
