"""Triton n-gram hash: packed token ids -> [T, H] table row ids, one launch, no host syncs.

The hash is defined in `qwen4_exp_hcu.ple.hashing`; `spec` is its `NgramHashSpec`. Each program takes BLOCK_T
tokens, finds their request by a binary search over `query_start_loc` (fixed iteration count, so it captures
in a CUDA graph), walks back ngram_size-1 tokens (into the request's n-gram context when the chunk is too
short) with the EOS rule, and writes every head's row id. `ngram_ids_reference` is the same in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ngram_hash_kernel(
    ids_ptr, qsl_ptr, ctx_ptr, mult_ptr, sizes_ptr, offsets_ptr, out_ptr,
    T, B, search_steps,
    EOS: tl.constexpr, N: tl.constexpr, PER: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    # request of each token: largest r with qsl[r] <= t
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = tl.zeros([BLOCK_T], dtype=tl.int64) + B
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        nxt = tl.load(qsl_ptr + mid + 1, mask=tmask & (lo < hi), other=0).to(tl.int64)
        go_right = t >= nxt
        lo = tl.where((lo < hi) & go_right, mid + 1, lo)
        hi = tl.where((lo < hi) & ~go_right, mid, hi)
    req = tl.minimum(lo, B - 1)
    i = t - tl.load(qsl_ptr + req, mask=tmask, other=0).to(tl.int64)

    heads = tl.arange(0, H_PAD)
    hmask = heads < H
    sizes = tl.load(sizes_ptr + heads, mask=hmask, other=1)
    offsets = tl.load(offsets_ptr + heads, mask=hmask, other=0)
    order = heads // PER + 2  # n-gram order of each head

    tok = tl.load(ids_ptr + t, mask=tmask, other=0).to(tl.int64)
    mixed = tok * tl.load(mult_ptr)
    blocked = tok != tok  # all False
    key = tl.zeros([BLOCK_T, H_PAD], dtype=tl.int64)
    for k in tl.static_range(1, N):
        j = i - k
        in_chunk = j >= 0
        prev = tl.load(ids_ptr + t - k, mask=tmask & in_chunk, other=0).to(tl.int64)
        from_ctx = tl.load(ctx_ptr + req * (N - 1) + (N - 1) + j, mask=tmask & ~in_chunk, other=0)
        prev = tl.where(in_chunk, prev, from_ctx.to(tl.int64))
        blocked = blocked | (prev == EOS)
        prev = tl.where(blocked, EOS, prev)
        mixed = mixed ^ (prev * tl.load(mult_ptr + k))
        key = tl.where(order[None, :] == k + 1, mixed[:, None], key)
    row = key % sizes[None, :]
    row = tl.where(row < 0, row + sizes[None, :], row) + offsets[None, :]
    tl.store(out_ptr + t[:, None] * H + heads[None, :], row, mask=tmask[:, None] & hmask[None, :])


_SPEC_TENSORS: dict = {}  # (spec, device) -> its multiplier/size/offset tensors


def _spec_tensors(spec, device):
    """Hash constants live on the device once per (spec, device): no per-call H2D copy."""
    key = (spec, str(device))
    if key not in _SPEC_TENSORS:
        _SPEC_TENSORS[key] = spec.tensors(device)
    return _SPEC_TENSORS[key]


def ngram_hash(spec, input_ids, query_start_loc, ngram_context, out=None, block_t: int = 64) -> torch.Tensor:
    T, B = input_ids.shape[0], query_start_loc.shape[0] - 1
    if out is None:
        out = torch.empty(T, spec.num_heads, dtype=torch.int64, device=input_ids.device)
    if T == 0:
        return out
    mult, sizes, offsets = _spec_tensors(spec, input_ids.device)
    ctx = ngram_context if ngram_context.dtype == torch.int64 and ngram_context.is_contiguous() else ngram_context.long().contiguous()
    _ngram_hash_kernel[(triton.cdiv(T, block_t),)](
        input_ids, query_start_loc, ctx, mult, sizes, offsets, out,
        T, B, max(1, B.bit_length()),
        EOS=spec.eos_token_id, N=spec.ngram_size, PER=spec.heads_per_ngram, H=spec.num_heads,
        H_PAD=triton.next_power_of_2(spec.num_heads), BLOCK_T=block_t,
    )
    return out


def _shifted_tokens(spec, input_ids, query_start_loc, ngram_context) -> list[torch.Tensor]:
    """shift_k(t) for k = 0..N-1 with the EOS rule, each int64 [T]."""
    T = input_ids.shape[0]
    ids = input_ids.long()
    qsl = query_start_loc.long()
    pos = torch.arange(T, device=ids.device)
    req = torch.searchsorted(qsl[1:], pos, right=True).clamp_max(ngram_context.shape[0] - 1)
    i = pos - qsl[req]
    ctx = ngram_context.long()
    shifted, blocked = [ids], torch.zeros(T, dtype=torch.bool, device=ids.device)
    for k in range(1, spec.ngram_size):
        j = i - k
        from_chunk = ids[(pos - k).clamp_min(0)]
        from_ctx = ctx[req, (spec.context_len + j).clamp(0, spec.context_len - 1)]
        tok = torch.where(j >= 0, from_chunk, from_ctx)
        blocked = blocked | (tok == spec.eos_token_id)
        shifted.append(torch.where(blocked, spec.eos_token_id, tok))
    return shifted


def ngram_ids_reference(spec, input_ids, query_start_loc, ngram_context) -> torch.Tensor:
    """Torch reference: int64 [T, H] row ids for a packed batch (request r = tokens qsl[r]:qsl[r+1])."""
    mult, sizes, offsets = spec.tensors(input_ids.device)
    shifted = _shifted_tokens(spec, input_ids, query_start_loc, ngram_context)
    mixed, blocks = shifted[0] * mult[0], []
    for n in range(2, spec.ngram_size + 1):
        mixed = mixed ^ (shifted[n - 1] * mult[n - 1])
        h = slice((n - 2) * spec.heads_per_ngram, (n - 1) * spec.heads_per_ngram)
        blocks.append(torch.remainder(mixed[:, None], sizes[h]) + offsets[h])
    return torch.cat(blocks, dim=1)
