"""The PLE layer's gate in one Triton kernel: the key and query grouped norms, the per-stream gate
`sign(g) * sqrt(|g|)` of `g = <key, query> / sqrt(hidden)`, `sigmoid(gate) * value`, and the conv input's grouped
norm of that (`ple.layer`; about a dozen small torch ops otherwise, each a kernel, eager in vLLM's breakable
graphs). Rounds to the activation dtype where the torch reference does, so the two differ only where an fp32
sum order, rsqrt or sigmoid tips a rounding."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qwen4_exp_hcu.kernels.hyper_connection import group_rms_norm, group_warps, inject_norm_reference


def ple_gate_reference(key, hidden, value, key_w, query_w, conv_w, eps: float, group: int):
    """(gated [T, hc*H], its grouped norm): `key` the key projection [T, hc*H], `hidden` the streams, `value` [T, H]."""
    streams = (key.shape[0], key.shape[1] // group, group)  # explicit: a batch of no tokens too
    k = inject_norm_reference(key, key_w, eps, group)[1].view(streams)
    q = inject_norm_reference(hidden, query_w, eps, group)[1].view(streams)
    gate = (k * q).sum(-1, keepdim=True) / math.sqrt(group)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value[:, None, :]).flatten(1)
    return gated, inject_norm_reference(gated, conv_w, eps, group)[1]


@triton.jit
def _ple_gate_kernel(
    key_ptr, hidden_ptr, value_ptr, kw_ptr, qw_ptr, cw_ptr, gated_ptr, normed_ptr, G, eps, root,
    HC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (token, stream): one group of every [T, HC * G] tensor."""
    row, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < G
    at = row * HC * G + g * G + cols
    key = tl.load(key_ptr + at, mask=mask, other=0.0)
    dt = key.dtype
    k = group_rms_norm(key, kw_ptr, g, G, cols, mask, eps).to(dt)
    q = group_rms_norm(tl.load(hidden_ptr + at, mask=mask, other=0.0), qw_ptr, g, G, cols, mask, eps).to(dt)
    gate = tl.sum((k.to(tl.float32) * q.to(tl.float32)).to(dt).to(tl.float32), axis=0).to(dt).to(tl.float32)
    gate = (gate / root).to(dt).to(tl.float32)
    mag = tl.sqrt(tl.maximum(tl.abs(gate), 1e-6).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    gate = tl.where(gate > 0, mag, tl.where(gate < 0, -mag, 0.0))
    weight = tl.sigmoid(gate).to(dt).to(tl.float32)
    gated = (weight * tl.load(value_ptr + row * G + cols, mask=mask, other=0.0).to(tl.float32)).to(dt)
    tl.store(gated_ptr + at, gated, mask=mask)
    tl.store(normed_ptr + at, group_rms_norm(gated, cw_ptr, g, G, cols, mask, eps).to(dt), mask=mask)


def ple_gate(key, hidden, value, key_w, query_w, conv_w, eps: float, group: int):
    """`ple_gate_reference` as one kernel."""
    if key.shape[-1] % group or key.shape != hidden.shape or value.shape != (key.shape[0], group):
        raise ValueError(f"ple_gate: key {tuple(key.shape)}, hidden {tuple(hidden.shape)}, value {tuple(value.shape)} for groups of {group}.")
    key, hidden, value = key.contiguous(), hidden.contiguous(), value.contiguous()
    gated, normed = torch.empty_like(key), torch.empty_like(key)
    if key.shape[0]:
        block = triton.next_power_of_2(group)
        _ple_gate_kernel[(key.shape[0], key.shape[1] // group)](
            key, hidden, value, key_w, query_w, conv_w, gated, normed, group, eps, math.sqrt(group),
            HC=key.shape[1] // group, BLOCK=block, num_warps=group_warps(block),
        )  # fmt: skip
    return gated, normed
