"""Hyper-connection glue in three Triton kernels: without torch.compile (vLLM's default for Qwen4Exp: breakable
graphs) each torch op of the grouped norm, the gated mix and the stream injection is a kernel of its own, about twenty
per hyper-connection; in a CUDA graph at small batches their launches, not their bytes, set the time. On NVIDIA from
Hopper they launch as programmatic dependents (`launch_pdl`), as does `down_silu` (the merged down GEMM with the
silu at decode sizes, `kernels.down_silu`).

* `inject_norm`: `streams + w[s] * block_out` for each stream s (optional) fused with the zero-centred grouped
  RMSNorm of every group (the norm optional too: the injection alone ends a decoder layer);
* `scaled_silu`: `silu(x / scale)` (the low-rank activation);
* `gate_mix`: `mean_s(sigmoid(up[s]) * normed[s])`, and `2 * sigmoid(logits / hc)` (the injection weights). The up
  GEMM before it stays the GEMM library's: its tiles are the larger part of the work, and a Triton GEMM that carried
  `gate_mix` as its epilogue would give them up for one saved launch.

Each rounds to the activation dtype where the torch references (`*_reference`, the library's CPU path and
Inductor's input) do, so they differ only where the norm's fp32 sum order or an fp32 sigmoid, division or rsqrt
tips a rounding, one bf16 step each.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from qwen4_exp_hcu.env import pdl_enabled

# `gate_mix`'s columns a program by rows (the first bound that holds): narrow blocks give a few rows more programs;
# the H200 sweep's best with dependent launch (`bench_hyper_connection.py --sweep`)
GATE_MIX_BLOCKS = ((4, 128), (None, 512))


@triton.jit
def group_rms_norm(x, w_ptr, g, G, cols, mask, eps):
    """The zero-centred RMSNorm of group g (one program's `cols`), in fp32; also the PLE gate's three norms."""
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / G + eps)
    return h * (1.0 + tl.load(w_ptr + g * G + cols, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _inject_norm_kernel(
    x_ptr, block_ptr, w_ptr, norm_w_ptr, streams_ptr, normed_ptr, G, eps,
    N_GROUPS: tl.constexpr, INJECT: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr, launch_pdl: tl.constexpr,
):  # fmt: skip
    row, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < G
    at = row * N_GROUPS * G + g * G + cols
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + at, mask=mask, other=0.0)
    if INJECT:
        b = tl.load(block_ptr + row * G + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + row * N_GROUPS + g).to(tl.float32)
    if launch_pdl:
        tl.extra.cuda.gdc_launch_dependents()
    if INJECT:
        x = (x.to(tl.float32) + (w * b.to(tl.float32)).to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(streams_ptr + at, x, mask=mask)
    if NORM:
        h = group_rms_norm(x, norm_w_ptr, g, G, cols, mask, eps)
        tl.store(normed_ptr + at, h.to(normed_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled_silu_kernel(x_ptr, out_ptr, N, x_stride, scale, BLOCK: tl.constexpr, launch_pdl: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if launch_pdl:
        tl.extra.cuda.gdc_launch_dependents()
    x = (x.to(tl.float32) / scale).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (x * tl.sigmoid(x)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gate_mix_kernel(
    up_ptr, normed_ptr, logits_ptr, mixed_ptr, weights_ptr, H, logits_stride,
    HC: tl.constexpr, HC_P2: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK: tl.constexpr, launch_pdl: tl.constexpr,
):  # fmt: skip
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
    for s in tl.static_range(HC):
        at = row * HC * H + s * H + cols
        up = tl.load(up_ptr + at, mask=mask, other=0.0)
        gate = tl.sigmoid(up.to(tl.float32)).to(up.dtype).to(tl.float32)
        normed = tl.load(normed_ptr + at, mask=mask, other=0.0).to(tl.float32)
        acc += (gate * normed).to(up.dtype).to(tl.float32)
    if launch_pdl:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(mixed_ptr + row * H + cols, (acc / HC).to(mixed_ptr.dtype.element_ty), mask=mask)
    if WEIGHTS:
        if blk == 0:
            _injection_weights(logits_ptr, weights_ptr, row + tl.arange(0, 1), tl.full([1], True, tl.int1), logits_stride, HC, HC_P2)


@triton.jit
def _injection_weights(logits_ptr, weights_ptr, rows, row_ok, logits_stride, HC: tl.constexpr, HC_P2: tl.constexpr):
    """`2 * sigmoid(logits / hc)` of `rows`, rounded where the reference rounds."""
    streams = tl.arange(0, HC_P2)
    mask = row_ok[:, None] & (streams < HC)[None, :]
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * logits_stride + streams[None, :], mask=mask, other=0.0)
    scaled = (logits.to(tl.float32) / HC).to(logits.dtype).to(tl.float32)
    weights = 2.0 * tl.sigmoid(scaled).to(logits.dtype).to(tl.float32)
    tl.store(weights_ptr + rows[:, None] * HC + streams[None, :], weights.to(weights_ptr.dtype.element_ty), mask=mask)


def launch_pdl(t: torch.Tensor) -> bool:
    """Programmatic dependent launch for a kernel over `t` (as vLLM's own hyper-connection kernels launch): the
    kernel starts while the one before it drains, waits for it (`gdc_wait`) before reading anything it may have
    written, and lets the next one start once its own loads are issued. NVIDIA from Hopper only (`griddepcontrol`);
    off on ROCm, the CPU and with QWEN4_EXP_HCU_PDL=0. One flag, passed as the kernels' `launch_pdl` constexpr,
    is also Triton's launch option of that name."""
    return t.device.type == "cuda" and pdl_enabled() and _has_pdl(t.device)


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Hopper or later under CUDA, with a Triton that has the `griddepcontrol` instructions (3.4 on)."""
    cuda = getattr(tl.extra, "cuda", None)
    gdc = hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
    return gdc and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def group_warps(block: int) -> int:
    """A whole group per program: more warps for wider groups (a group of 2560 values -> 8, the MTP head's single
    group of 10 240 -> 16): at most 32 values per thread up to that width."""
    return min(max(block // 512, 4), 16)


def inject_norm_reference(
    x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, group: int,
    block_out: torch.Tensor | None = None, weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(x with `weights[:, s] * block_out` added to group s, or x itself; its grouped norm, or None)."""
    if block_out is not None:
        x = x + (weights.unsqueeze(-1) * block_out.unsqueeze(-2)).flatten(-2)
    if norm_weight is None:
        return x, None
    h = x.float().unflatten(-1, (-1, group))
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return x, (h * (1.0 + norm_weight.float())).type_as(x)


def inject_norm(
    x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, group: int,
    block_out: torch.Tensor | None = None, weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    if x.shape[-1] % group:
        raise ValueError(f"inject_norm: width {x.shape[-1]} is not a multiple of group {group}")
    x = x.contiguous()
    rows, n_groups, block = x.numel() // x.shape[-1], x.shape[-1] // group, triton.next_power_of_2(group)
    streams = x if block_out is None else torch.empty_like(x)
    normed = None if norm_weight is None else torch.empty_like(x)
    if rows:
        _inject_norm_kernel[(rows, n_groups)](
            x, x if block_out is None else block_out.contiguous(), x if weights is None else weights.contiguous(),
            x if norm_weight is None else norm_weight, streams, x if normed is None else normed, group, eps,
            N_GROUPS=n_groups, INJECT=block_out is not None, NORM=norm_weight is not None, BLOCK=block,
            num_warps=group_warps(block), launch_pdl=launch_pdl(x),
        )  # fmt: skip
    return streams, normed


def scaled_silu_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.silu(x / scale)


def scaled_silu(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x`: `[rows, n]`, rows at any stride (a column slice of a wider GEMM output is read in place)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        n = x.shape[-1]
        _scaled_silu_kernel[(x.shape[0],)](
            x, out, n, x.stride(0), scale, BLOCK=triton.next_power_of_2(n), launch_pdl=launch_pdl(x)
        )
    return out


def gate_mix_reference(
    up: torch.Tensor, normed: torch.Tensor, hc: int, logits: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the streams' gated mean `[T, H]`; the injection weights `[T, hc]` of `logits`, or None). `logits` may be
    a column slice of a wider GEMM output."""
    mix = torch.sigmoid(up).unflatten(-1, (hc, -1))
    mixed = (mix * normed.unflatten(-1, (hc, -1))).mean(dim=-2)
    return mixed, None if logits is None else 2 * torch.sigmoid(logits / hc)


def gate_mix(
    up: torch.Tensor, normed: torch.Tensor, hc: int, logits: torch.Tensor | None = None, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gate_mix_reference` in one launch: a program per row and `block` columns (None: `GATE_MIX_BLOCKS`)."""
    up, normed = up.contiguous(), normed.contiguous()
    rows, h = up.numel() // up.shape[-1], up.shape[-1] // hc
    block = block or next(b for most, b in GATE_MIX_BLOCKS if most is None or rows <= most)
    mixed = up.new_empty(*up.shape[:-1], h)
    if logits is not None and logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = None if logits is None else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if rows:
        block = min(block, triton.next_power_of_2(h))
        _gate_mix_kernel[(rows, triton.cdiv(h, block))](
            up, normed, up if logits is None else logits, mixed, mixed if weights is None else weights, h,
            0 if logits is None else logits.stride(0),
            HC=hc, HC_P2=triton.next_power_of_2(hc), WEIGHTS=logits is not None, BLOCK=block, launch_pdl=launch_pdl(up),
        )  # fmt: skip
    return mixed, weights
