"""Hyper-connection glue in three Triton kernels, and one that fuses it with a GEMM at decode sizes: without
torch.compile (vLLM's default for Qwen4Exp: breakable graphs) each torch op of the grouped norm, the gated mix and
the stream injection is a kernel of its own, about twenty per hyper-connection; in a CUDA graph at small batches
their launches, not their bytes, set the time. On NVIDIA from Hopper they launch as programmatic dependents.

* `inject_norm`: `streams + w[s] * block_out` for each stream s (optional) fused with the zero-centred grouped
  RMSNorm of every group (the norm optional too: the injection alone ends a decoder layer);
* `scaled_silu`: `silu(x / scale)` (the low-rank activation);
* `gate_mix`: `mean_s(sigmoid(up[s]) * normed[s])`, and `2 * sigmoid(logits / hc)` (the injection weights);
* `down_silu`: at a few tokens (decode), the merged down + injection GEMM with `scaled_silu` on its down columns,
  one launch where cuBLAS took a split-K GEMM, its reduction and the silu (vLLM's class fuses the same with a
  CuTe DSL kernel, NVIDIA only). The up GEMM with `gate_mix` as its epilogue lost to cuBLAS + `gate_mix` at every
  decode size on the H200 (0.65-0.99x, docs/PERFORMANCE.md): the up GEMM stays the GEMM library's.

Each rounds to the activation dtype where the torch references (`*_reference`, the library's CPU path and
Inductor's input) do, so they differ only where the norm's fp32 sum order or an fp32 sigmoid, division or rsqrt
tips a rounding, one bf16 step each.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwen4_exp_hcu.env import DOWN_SILU_ENV, pdl_enabled


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


@triton.jit
def _down_silu_store(total, down_ptr, rest_ptr, rows, row_ok, cols, N, rank, scale):
    """Rounds the fp32 sums as the GEMM's bf16 output; columns < rank through the scaled silu into `down`, the
    others < N into `rest`. `down`'s mask leaves N out: its columns end at rank (a multiple of 16 in the release),
    so its stores stay vectorized where N is not."""
    y = total.to(down_ptr.dtype.element_ty)
    h = (y.to(tl.float32) / scale).to(y.dtype).to(tl.float32)
    is_down = (cols < rank)[None, :]
    tl.store(down_ptr + rows[:, None] * rank + cols[None, :], (h * tl.sigmoid(h)).to(y.dtype), mask=row_ok[:, None] & is_down)
    rest_ok = row_ok[:, None] & ~is_down & (cols < N)[None, :]
    tl.store(rest_ptr + rows[:, None] * (N - rank) + (cols[None, :] - rank), y, mask=rest_ok)


@triton.jit
def _gemm_weights(w_ptr, cols, col_ok, k, K, w_stride):
    """The weights of K block `k` for output columns `cols`, `[BLOCK_K, BLOCK_N]` (`down_silu`'s GEMM)."""
    return tl.load(w_ptr + cols[None, :].to(tl.int64) * w_stride + k[:, None], mask=(k < K)[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _gemm_block(acc, x_ptr, w, rows, row_ok, k, K, x_stride, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """`acc` plus the products over the K block `k` (`w`: its weights)."""
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
    if UPCAST:  # Triton's interpreter multiplies bf16 dots wrongly; fp32 holds bf16 values exactly
        x, w = x.to(tl.float32), w.to(tl.float32)
    if DOT:
        acc = tl.dot(x, w, acc, input_precision="ieee")  # fp32 models: no tf32
    else:  # one row: multiply-adds (a dot needs 16 rows)
        acc += tl.sum(x[:, :, None].to(tl.float32) * w[None, :, :].to(tl.float32), axis=1)
    return acc


@triton.jit(do_not_specialize=["T"])  # one kernel per block shape, not a second one for a single token
def _down_silu_kernel(
    x_ptr, w_ptr, down_ptr, rest_ptr, part_ptr, count_ptr, T, K, N, x_stride, w_stride, part_stride, rank, scale,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, WARM_COUNTER: tl.constexpr, launch_pdl: tl.constexpr,
):  # fmt: skip
    """Program (column block, row block, K split): its fp32 partial sum into `part`; the last split to finish a
    tile (a counter per tile) adds the SPLIT partials in split order (deterministic, unlike atomic adds), rounds
    as the GEMM's bf16 output, stores columns < rank through the scaled silu into `down` and the others into
    `rest` (both contiguous: the up GEMM reads `down`), and resets the counter. One split stores directly. A partial
    row is `part_stride` wide, N rounded up to 16, and masked by that width: Triton vectorizes what it knows is
    16-aligned, and the release's N = 324 is not (scalar partial loads and stores there). The
    first K block's weights load before the wait for the previous kernel (`launch_pdl`): they are parameters, not
    its output, so with 10 splits of one K block at one token, all of a launch's weight reads overlap the kernel
    before it. The model's default above WHOLE_ROWS_MAX_TOKENS rows; up to there `_down_silu_rows_kernel` is (this one
    there only with `whole_rows=False`, for the sweep). WARM_COUNTER: an atomic add of 0 to the tile's counter beside
    those loads, so that the counter's line is in L2 by the time the split's partial is stored (in a decode step
    each hyper-connection's counters were last touched a step ago)."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile = pid_m * tl.num_programs(0) + pid_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < T, cols < N
    span = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * span  # a split past K (K / SPLIT not a whole block) loads nothing
    w = _gemm_weights(w_ptr, cols, col_ok, first + ks, K, w_stride)
    if WARM_COUNTER and SPLIT > 1:
        tl.atomic_add(count_ptr + tile, 0, sem="relaxed")
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
    acc = _gemm_block(acc, x_ptr, w, rows, row_ok, first + ks, K, x_stride, DOT, UPCAST)
    for k0 in range(first + BLOCK_K, tl.minimum(first + span, K), BLOCK_K):
        w = _gemm_weights(w_ptr, cols, col_ok, k0 + ks, K, w_stride)
        acc = _gemm_block(acc, x_ptr, w, rows, row_ok, k0 + ks, K, x_stride, DOT, UPCAST)
    if launch_pdl:
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT == 1:  # the whole K in this program: no partials, no counter
        _down_silu_store(acc, down_ptr, rest_ptr, rows, row_ok, cols, N, rank, scale)
    else:
        mask = row_ok[:, None] & (cols < part_stride)[None, :]  # columns past N hold zeros (masked weights)
        at = rows[:, None] * part_stride + cols[None, :]
        tl.store(part_ptr + split * T * part_stride + at, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the counter's release (one thread performs it)
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                total += tl.load(part_ptr + i * T * part_stride + at, mask=mask, other=0.0, cache_modifier=".cg")
            _down_silu_store(total, down_ptr, rest_ptr, rows, row_ok, cols, N, rank, scale)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


@triton.jit(do_not_specialize=["T"])
def _down_silu_rows_kernel(
    x_ptr, w_ptr, down_ptr, rest_ptr, T, K, N, x_stride, w_stride, rank, scale,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_ROWS: tl.constexpr, K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr, launch_pdl: tl.constexpr,
):  # fmt: skip
    """Program per `BLOCK_N` columns and ROWS token rows, holding its whole weight rows in registers, K as HEAD_ROWS
    blocks of K_BLOCK and, with TAIL, one masked block after them (10 240 = 4 x 2 048 + 2 048), all loaded before the
    wait for the previous kernel, so a launch's weight reads overlap it entirely; then multiply-adds with its rows (x
    from L2). More rows: programs along the grid's second axis, each reading the weights again (from L2 after the
    first). Every x load is issued before any sum, and the blocks are added within each thread before one reduction
    across threads for all rows: summed a block (or a row) at a time, each next x load waited for the previous
    reduction and its barrier, an L2 round trip each. No K splits, no partials: vLLM's CuTe FMA kernel's scheme."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # 4-D throughout, [rows, columns, K blocks, K_BLOCK], so that no loaded tensor changes layout (through shared memory)
    ks = tl.arange(0, K_BLOCK)[None, None, None, :]
    head = tl.arange(0, HEAD_ROWS)[None, None, :, None] * K_BLOCK + ks
    tail = HEAD_ROWS * K_BLOCK + ks
    col_ok = cols[None, :, None, None] < N
    w_rows = w_ptr + cols[None, :, None, None].to(tl.int64) * w_stride
    w_head = tl.load(w_rows + head, mask=col_ok, other=0.0)  # [1, BLOCK_N, HEAD_ROWS, K_BLOCK]
    if TAIL:
        w_tail = tl.load(w_rows + tail, mask=col_ok & (tail < K), other=0.0)  # [1, BLOCK_N, 1, K_BLOCK]
    if launch_pdl:
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    row_ok = rows[:, None, None, None] < T
    x_rows = x_ptr + rows[:, None, None, None].to(tl.int64) * x_stride
    x_head = tl.load(x_rows + head, mask=row_ok, other=0.0)  # [ROWS, 1, HEAD_ROWS, K_BLOCK]
    if TAIL:
        x_tail = tl.load(x_rows + tail, mask=row_ok & (tail < K), other=0.0)
    part = tl.sum(x_head.to(tl.float32) * w_head.to(tl.float32), axis=2)  # [ROWS, BLOCK_N, K_BLOCK]
    if TAIL:
        part += tl.sum(x_tail.to(tl.float32) * w_tail.to(tl.float32), axis=2)
    _down_silu_store(tl.sum(part, axis=2), down_ptr, rest_ptr, rows, rows < T, cols, N, rank, scale)
    if launch_pdl:
        tl.extra.cuda.gdc_launch_dependents()


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
    """`gate_mix_reference` in one launch: a program per row and `block` columns (None: 128 up to 4 rows, 512
    above; the H200 sweep's best with dependent launch, 1.06 against 1.16 us at one row, 1.39 against 1.90 at 32:
    benchmarks/results/hyper_connection)."""
    up, normed = up.contiguous(), normed.contiguous()
    rows, h = up.numel() // up.shape[-1], up.shape[-1] // hc
    block = block or (128 if rows <= 4 else 512)
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


# `down_silu` against cuBLAS's split-K GEMM, its reduction and `scaled_silu` (each hyper-connection its own weights,
# from HBM as in serving): ahead at every size up to 32 tokens on the H200 (benchmarks/results/hyper_connection)
DOWN_SILU_MAX_TOKENS = 32
SPLIT_16_MAX_TOKENS = 16  # 16 splits of K blocks of 128 up to here: fastest in the served decode step at 16 rows
WHOLE_ROWS_MAX_TOKENS = 4  # the default's whole rows (any number with `whole_rows=True`): slower than split-K above
WHOLE_ROWS_PER_PROGRAM = 4  # multiply-adds over each row re-read the weights from registers, x from L2 (as CuTe's FMA);
# all 4 rows' x in registers: 240 registers a thread at 4 warps, no spills (ptxas, sm_90a)
DOWN_SILU_TILES = 256  # counters a caller holds: column x row blocks of a K-split launch (2 columns at N = 336: 168)


@dataclass(frozen=True)
class DownSiluConfig:
    """`down_silu`'s split-K launch: programs = column blocks (`block_n` columns; 16 or more for `tl.dot`, from 2 rows)
    x row blocks x `split` K splits (1: no partial sums), each stepping through its K span `block_k` at a time, or
    whole weight rows. The defaults: the H200 sweep's best at the release's shape, weights beyond L2, split-K's timed
    inside the whole hyper-connection block, whose ranking serving follows where the launch timed alone does not
    (`benchmarks/bench_hyper_connection.py --sweep`, benchmarks/results/hyper_connection)."""

    split: int | None = None  # None: 16 up to SPLIT_16_MAX_TOKENS rows with `tl.dot`, else 10
    block_n: int | None = None  # None: 1 for whole rows, else 4 at one row (multiply-adds), 16 with `tl.dot`
    block_k: int | None = None  # None: with `tl.dot` 128 up to SPLIT_16_MAX_TOKENS rows, 256 above; 1024 without
    num_warps: int | None = None  # None: 2 at one row, 4 with `tl.dot`; whole rows 2 at one row, 4 from two (8 is slower)
    warm_counter: bool | None = None  # split-K touches its tile's counter before the wait (`_down_silu_kernel`); None:
    # with `tl.dot`, where it is slightly faster inside the whole block
    whole_rows: bool | None = None  # `_down_silu_rows_kernel` (split, block_k, warm_counter unused);
    # None: up to WHOLE_ROWS_MAX_TOKENS, where reading x in one round trip beats 10 splits

    def label(self) -> str:
        """The sweep's name for the launch (`benchmarks/bench_hyper_connection.py`), which `parse` reads back."""
        if self.whole_rows:
            return f"rows_n{self.block_n}_w{self.num_warps}"
        return f"split{self.split}_n{self.block_n}_k{self.block_k}_w{self.num_warps}" + ("_wc" if self.warm_counter else "")

    @classmethod
    def parse(cls, label: str) -> DownSiluConfig:
        if m := re.fullmatch(r"rows_n(\d+)_w(\d+)", label):
            n, w = map(int, m.groups())
            return cls(whole_rows=True, block_n=n, num_warps=w)
        if m := re.fullmatch(r"split(\d+)_n(\d+)_k(\d+)_w(\d+)(_wc)?", label):
            s, n, k, w = map(int, m.groups()[:4])
            return cls(split=s, block_n=n, block_k=k, num_warps=w, warm_counter=bool(m[5]), whole_rows=False)
        raise ValueError(f"{DOWN_SILU_ENV}={label!r}: not a launch of the sweep's, e.g. 'rows_n1_w4' or "
                         "'split10_n16_k128_w4'")


@functools.cache
def configured_launch() -> DownSiluConfig:
    """The model's `down_silu` launch at every token count it fuses: `QWEN4_EXP_HCU_DOWN_SILU` (a sweep's label),
    to serve a config the sweep found before it becomes the default; unset, the default's."""
    label = os.environ.get(DOWN_SILU_ENV, "").strip()
    config = DownSiluConfig.parse(label) if label else DownSiluConfig()
    if config.whole_rows is False and config.block_n < 16:  # a one-token launch: above one token `tl.dot` refuses it
        raise ValueError(f"{DOWN_SILU_ENV}={label!r}: split-K over {config.block_n} columns serves one token only, "
                         "and the model fuses every decode size (16 columns or more)")
    return config


def down_silu_reference(
    x: torch.Tensor, weight: torch.Tensor, rank: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`scaled_silu` of `x @ weight.T`'s first `rank` columns, its other columns), each contiguous."""
    y = torch.nn.functional.linear(x, weight)
    return scaled_silu_reference(y[:, :rank], scale), y[:, rank:].contiguous()


def down_silu(
    x: torch.Tensor, weight: torch.Tensor, rank: int, scale: float, counts: torch.Tensor,
    config: DownSiluConfig = DownSiluConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`down_silu_reference` in one launch for 1..DOWN_SILU_MAX_TOKENS rows; `counts`: int32 zeros, at least
    DOWN_SILU_TILES, each launch leaves them zero (the caller's, not shared across streams). `config`: the
    launch (`benchmarks/bench_hyper_connection.py` sweeps it)."""
    (t, k), n = x.shape, weight.shape[0]
    if not 1 <= t <= DOWN_SILU_MAX_TOKENS:
        raise ValueError(f"down_silu: {t} rows; it serves 1..{DOWN_SILU_MAX_TOKENS}, a GEMM library the rest")
    # rows at any stride (ROCm's vLLM pads a weight's rows against cache aliasing), columns contiguous
    x, weight = (a if a.stride(-1) == 1 else a.contiguous() for a in (x, weight))
    if config.whole_rows or (config.whole_rows is None and t <= WHOLE_ROWS_MAX_TOKENS):
        return _down_silu_whole_rows(x, weight, rank, scale, config)
    dot = t > 1  # measured on the H200: multiply-adds win at one row only (4 rows: 0.62x the GEMM library)
    block_m, block_n = max(16 if dot else 1, triton.next_power_of_2(t)), config.block_n or (16 if dot else 4)
    if dot and block_n < 16:
        raise ValueError(f"down_silu: {t} rows take tl.dot, which needs blocks of 16 columns or more, got {block_n}")
    few = dot and t <= SPLIT_16_MAX_TOKENS
    block_k = config.block_k or ((128 if few else 256) if dot else 1024)
    grid = (triton.cdiv(n, block_n), triton.cdiv(t, block_m), config.split or (16 if few else 10))
    warm_counter = dot if config.warm_counter is None else config.warm_counter
    if grid[2] > 1 and counts.numel() < grid[0] * grid[1]:
        raise ValueError(f"down_silu: {counts.numel()} tile counters for {grid[0] * grid[1]} tiles")
    down, rest = x.new_empty(t, rank), x.new_empty(t, n - rank)
    part_stride = triton.cdiv(n, 16) * 16
    part = torch.empty(grid[2], t, part_stride, dtype=torch.float32, device=x.device) if grid[2] > 1 else down  # unused at 1
    _down_silu_kernel[grid](
        x, weight, down, rest, part, counts, t, k, n, x.stride(0), weight.stride(0), part_stride, rank, scale,
        SPLIT=grid[2], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, UPCAST=x.device.type == "cpu",
        WARM_COUNTER=warm_counter, num_warps=config.num_warps or (4 if dot else 2), launch_pdl=launch_pdl(x),
    )  # fmt: skip
    return down, rest


def _down_silu_whole_rows(x: torch.Tensor, weight: torch.Tensor, rank: int, scale: float, config: DownSiluConfig):
    (t, k), n = x.shape, weight.shape[0]
    head = 1 << (k.bit_length() - 1)  # K = head + tail, the tail a masked power of two (0: none)
    tail = triton.next_power_of_2(k - head) if k > head else 0
    block = tail or head  # the head as head // block blocks of the tail's width
    down, rest = x.new_empty(t, rank), x.new_empty(t, n - rank)
    block_n, rows = config.block_n or 1, min(triton.next_power_of_2(t), WHOLE_ROWS_PER_PROGRAM)
    _down_silu_rows_kernel[(triton.cdiv(n, block_n), triton.cdiv(t, rows))](
        x, weight, down, rest, t, k, n, x.stride(0), weight.stride(0), rank, scale, ROWS=rows,
        BLOCK_N=block_n, HEAD_ROWS=head // block, K_BLOCK=block, TAIL=tail > 0,
        num_warps=config.num_warps or (2 if t == 1 else 4),
        launch_pdl=launch_pdl(x),
    )  # fmt: skip
    return down, rest
