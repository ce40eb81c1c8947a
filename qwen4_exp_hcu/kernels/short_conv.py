"""The PLE layer's per-request windows: its dilated causal short conv over each request's (window ++ chunk), and
the state update that keeps each request's new window in its cache slot. One kernel each, where the torch
references below take about 40 and 15 small ops (vLLM's breakable and piecewise graphs run them eagerly at
every step, and a full graph replays each as its own kernel).

A request's stored window sits in its slot from offset `num_accepted - 1` on (speculative layouts, see
`ple.batch`); a new request (`has_initial_state` false) or a padding one (slot < 0) reads `fill` instead.
Padding requests write nothing, so a real request in slot 0 is never overwritten (no host sync: usable inside a
CUDA graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# ---- torch references ---------------------------------------------------------------------------------
def history(window: torch.Tensor, chunk: torch.Tensor, qsl: torch.Tensor, req: torch.Tensor, j: torch.Tensor):
    """Entry j of each request's (window ++ chunk): j < 0 reads the window ([B, L, ...]), j >= 0 the
    packed chunk ([T, ...]); `req` and `j` are index tensors of one shape."""
    L, T = window.shape[1], chunk.shape[0]
    from_chunk = chunk[(qsl[req] + j).clamp(0, max(T - 1, 0))] if T else chunk.new_zeros(*j.shape, *chunk.shape[1:])
    from_window = window[req, (L + j).clamp(0, L - 1)]
    return torch.where((j >= 0).view(*j.shape, *[1] * (chunk.dim() - 1)), from_chunk, from_window)


def current_window(stored, slot_ids, has_initial_state, num_accepted, length: int, fill) -> torch.Tensor:
    """Each request's current `length` entries of its slot: from offset num_accepted - 1 (speculation),
    `fill` for new requests and padding."""
    slots = slot_ids.clamp(0, stored.shape[0] - 1)
    offset = 0 if num_accepted is None else (num_accepted.long() - 1)[:, None]
    rows = stored[slots[:, None], offset + torch.arange(length, device=stored.device)]
    live = (has_initial_state & (slot_ids >= 0)).view(-1, *[1] * (rows.dim() - 1))
    return torch.where(live, rows, fill)


def store_window_reference(stored, chunk, qsl, slot_ids, has_initial_state, num_accepted, verify, length: int, fill):
    """Store each request's tail of (window ++ chunk) in its slot: the last `length` entries, or, for a request
    that verifies k drafts, the last `length + k` (the window after each of its positions); zeros past the end."""
    window = current_window(stored, slot_ids, has_initial_state, num_accepted, length, fill)
    qsl, B, L = qsl.long(), slot_ids.shape[0], length
    n = qsl[1:] - qsl[:-1]
    drafts = torch.zeros_like(n) if verify is None else torch.where(verify, (n - 1).clamp_min(0), 0)
    j = (n - L - drafts)[:, None] + torch.arange(stored.shape[1], device=n.device)
    req = torch.arange(B, device=n.device)[:, None].expand_as(j)
    rows = history(window, chunk, qsl, req, j)
    rows = torch.where((j < n[:, None]).view(*j.shape, *[1] * (rows.dim() - 2)), rows, 0)
    keep = (slot_ids >= 0) & (slot_ids < stored.shape[0])
    stored[slot_ids[keep].long()] = rows[keep].to(stored.dtype)
    return stored


def short_conv_reference(x, residual, stored, qsl, slot_ids, has_initial_state, num_accepted, weight, dilation: int):
    """`residual + silu(conv)`: the causal depthwise conv of `weight` [C, K], dilation `dilation`, over each
    request's (stored window ++ x); reads the windows, writes nothing."""
    T, B, K = x.shape[0], slot_ids.shape[0], weight.shape[1]
    qsl = qsl.long()
    window = current_window(stored, slot_ids, has_initial_state, num_accepted, (K - 1) * dilation, 0)  # [B, L, C]
    pos = torch.arange(T, device=x.device)
    req = torch.searchsorted(qsl[1:], pos, right=True).clamp_max(max(B - 1, 0))
    i = pos - qsl[req]
    acc = torch.zeros_like(x)
    for k in range(K):
        acc = acc + history(window, x, qsl, req, i - (K - 1 - k) * dilation) * weight[:, k]
    return torch.add(residual, F.silu(acc))


# ---- kernels ------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["fill"])  # a fill of 1 would become a Python int (no `.to`)
def _store_window_kernel(
    stored_ptr, chunk_ptr, qsl_ptr, slot_ptr, init_ptr, accepted_ptr, verify_ptr, fill,
    S, E, L, slot_stride, pos_stride,
    C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, HAS_ACCEPTED: tl.constexpr, HAS_VERIFY: tl.constexpr,
):  # fmt: skip
    """Program (request r, channel block): entries e of slot[r] <- entry n - L - drafts + e of (window ++ chunk)."""
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    if (slot >= 0) & (slot < S):
        start = tl.load(qsl_ptr + r).to(tl.int64)
        n = tl.load(qsl_ptr + r + 1).to(tl.int64) - start
        drafts = n * 0
        if HAS_VERIFY:
            drafts = tl.where(tl.load(verify_ptr + r).to(tl.int32) != 0, tl.maximum(n - 1, 0), 0)
        offset = n * 0
        if HAS_ACCEPTED:
            offset = tl.load(accepted_ptr + r).to(tl.int64) - 1
        e = tl.arange(0, BLOCK_E)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (e < E)[:, None] & (cols < C)[None, :]
        j = (n - L - drafts + e)[:, None]
        live = (j * 0 + tl.load(init_ptr + r).to(tl.int64)) != 0  # as a tensor: masks mix no scalar booleans
        from_chunk = (j >= 0) & (j < n)
        x = tl.load(chunk_ptr + (start + j) * C + cols[None, :], mask=mask & from_chunk, other=0)
        base = stored_ptr + slot * slot_stride + cols[None, :]
        w = tl.load(base + (offset + L + j) * pos_stride, mask=mask & (j < 0) & live, other=0)
        w = tl.where(live, w, fill.to(w.dtype))
        value = tl.where(from_chunk, x.to(w.dtype), tl.where(j < 0, w, 0))
        tl.debug_barrier()  # every entry read before any is overwritten: a later entry moves to an earlier one
        tl.store(base + e[:, None] * pos_stride, value, mask=mask)


@triton.jit
def _short_conv_kernel(
    x_ptr, res_ptr, out_ptr, stored_ptr, w_ptr, qsl_ptr, slot_ptr, init_ptr, accepted_ptr,
    B, S, dilation, slot_stride, pos_stride, steps,
    C: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr, HAS_ACCEPTED: tl.constexpr,
):  # fmt: skip
    """Program (token t, channel block): its request by binary search of the query start locations, then the
    K taps from the chunk or the request's stored window, accumulated in fp32."""
    t = tl.program_id(0).to(tl.int64)
    lo, hi = t * 0, t * 0 + B  # the request: how many of qsl[1..B] are <= t (then at most B - 1)
    for _ in range(steps):
        mid = (lo + hi) // 2
        right = (lo < hi) & (tl.load(qsl_ptr + tl.minimum(mid + 1, B)) <= t)
        hi = tl.where((lo < hi) & ~right, mid, hi)
        lo = tl.where(right, mid + 1, lo)
    r = tl.minimum(lo, B - 1)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    live = (cols * 0 + tl.load(init_ptr + r).to(tl.int64) * (slot >= 0).to(tl.int64)) != 0  # a tensor, as j below
    slot = tl.minimum(tl.maximum(slot, 0), S - 1)
    offset = t * 0
    if HAS_ACCEPTED:
        offset = tl.load(accepted_ptr + r).to(tl.int64) - 1
    L = (K - 1) * dilation
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for k in tl.static_range(K):
        j = cols * 0 + (t - start - (K - 1 - k) * dilation)
        x = tl.load(x_ptr + (start + j) * C + cols, mask=cmask & (j >= 0), other=0)
        w = tl.load(stored_ptr + slot * slot_stride + (offset + L + j) * pos_stride + cols, mask=cmask & (j < 0) & live, other=0)
        acc += tl.where(j >= 0, x, w).to(tl.float32) * tl.load(w_ptr + cols * K + k, mask=cmask, other=0).to(tl.float32)
    conv = (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty)
    res = tl.load(res_ptr + t * C + cols, mask=cmask, other=0)
    tl.store(out_ptr + t * C + cols, (res.to(tl.float32) + conv.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=cmask)


# ---- launchers ----------------------------------------------------------------------------------------
def _block(channels: int) -> int:
    return min(triton.next_power_of_2(max(channels, 1)), 1024)


def store_window(stored, chunk, qsl, slot_ids, has_initial_state, num_accepted, verify, length: int, fill):
    """`store_window_reference` as one kernel: `stored` [S, E] or [S, E, C] (a slot's rows contiguous per entry),
    `chunk` [T] or [T, C] of its dtype."""
    B = slot_ids.shape[0]
    if B:
        C = stored[0, 0].numel()
        if stored.dim() == 3 and stored.stride(2) != 1:
            raise ValueError("store_window: a state entry's channels must be contiguous.")
        chunk = chunk.contiguous()
        block = _block(C)
        _store_window_kernel[(B, triton.cdiv(C, block))](
            stored, chunk, qsl, slot_ids, has_initial_state, num_accepted if num_accepted is not None else qsl,
            verify if verify is not None else has_initial_state, fill,
            stored.shape[0], stored.shape[1], length, stored.stride(0), stored.stride(1),
            C=C, BLOCK_E=triton.next_power_of_2(stored.shape[1]), BLOCK_C=block,  # C: 1 (n-gram ids) or hc * hidden
            HAS_ACCEPTED=num_accepted is not None, HAS_VERIFY=verify is not None,
        )  # fmt: skip
    return stored


def short_conv(x, residual, stored, qsl, slot_ids, has_initial_state, num_accepted, weight, dilation: int, out=None):
    """`short_conv_reference` as one kernel: x, residual [T, C] contiguous, `stored` [S, E, C], weight [C, K]."""
    T, C = x.shape
    out = torch.empty_like(residual) if out is None else out
    if T:
        if stored.stride(2) != 1:
            raise ValueError("short_conv: a state entry's channels must be contiguous.")
        B, block = slot_ids.shape[0], _block(C)
        _short_conv_kernel[(T, triton.cdiv(C, block))](
            x.contiguous(), residual.contiguous(), out, stored, weight.contiguous(), qsl, slot_ids, has_initial_state,
            num_accepted if num_accepted is not None else qsl,
            B, stored.shape[0], dilation, stored.stride(0), stored.stride(1), max(B, 1).bit_length(),
            C=C, K=weight.shape[1], BLOCK_C=block, HAS_ACCEPTED=num_accepted is not None,
        )  # fmt: skip
    return out
