"""The hyper-connection's merged down + injection GEMM with the scaled silu on its down columns, in one launch at
decode sizes (1..DOWN_SILU_MAX_TOKENS tokens), where the GEMM library takes a split-K GEMM, its reduction and the silu
(vLLM's class fuses the same with a CuTe DSL kernel, NVIDIA only). Two schemes: whole weight rows a program (few
tokens), or K split over programs whose partial sums the last to finish adds in a fixed order. The launch is data
(`DownSiluConfig`, its defaults `DEFAULTS`), so that `benchmarks/bench_hyper_connection.py --sweep` can time others
and `QWEN4_EXP_HCU_DOWN_SILU` serve one."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qwen4_exp_hcu.env import DOWN_SILU_ENV
from qwen4_exp_hcu.kernels.hyper_connection import launch_pdl, scaled_silu_reference


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
    16-aligned, and the release's N = 324 is not (scalar partial loads and stores there). The first K block's
    weights load before the wait for the previous kernel (`launch_pdl`): they are parameters, not its output, so
    with one K block a split, all of a launch's weight reads overlap the kernel before it. WARM_COUNTER: an atomic
    add of 0 to the tile's counter beside those loads, so that the counter's line is in L2 by the time the split's
    partial is stored (in a decode step each hyper-connection's counters are last touched a step before)."""
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
    across threads for all rows: summed a block (or a row) at a time, each next x load would wait for the previous
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



DOWN_SILU_MAX_TOKENS = 32  # ahead of the GEMM library's split-K GEMM, reduction and silu at every size up to here
WHOLE_ROWS_PER_PROGRAM = 4  # x of 4 rows in registers beside the weights: no spills at 4 warps (ptxas, sm_90a)
DOWN_SILU_TILES = 256  # counters a caller holds: column x row blocks of a split-K launch (2 columns at N = 336: 168)


@dataclass(frozen=True)
class DownSiluConfig:
    """`down_silu`'s launch: programs = column blocks (`block_n` columns; 16 or more for `tl.dot`, from 2 rows)
    x row blocks x `split` K splits (1: no partial sums), each stepping through its K span `block_k` at a time, or
    whole weight rows. A field left None takes the default's (`DEFAULTS`)."""

    split: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    warm_counter: bool | None = None  # split-K touches its tile's counter before the wait (`_down_silu_kernel`)
    whole_rows: bool | None = None  # `_down_silu_rows_kernel` (split, block_k, warm_counter unused)

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


_ROWS, _SPLIT = functools.partial(DownSiluConfig, whole_rows=True), functools.partial(DownSiluConfig, whole_rows=False)
# The default launch for T tokens: the first entry whose bound is T or more and whose scheme (`whole_rows`) is the one
# asked for (None: either). Each is the H200 sweep's best at the release's shape, weights beyond L2, timed inside the
# whole hyper-connection block, whose ranking serving follows (`bench_hyper_connection.py --sweep`).
DEFAULTS = (
    (1, _ROWS(block_n=1, num_warps=2)),  # up to 4 tokens x read in one round trip beats any K split
    (4, _ROWS(block_n=1, num_warps=4)),  # from 2 tokens 4 warps; 8 are slower
    (1, _SPLIT(split=10, block_n=4, block_k=1024, num_warps=2, warm_counter=False)),  # K = 10 240 in 10 whole blocks
    (16, _SPLIT(split=16, block_n=16, block_k=128, num_warps=4, warm_counter=True)),  # the served decode step's best
    (DOWN_SILU_MAX_TOKENS, _SPLIT(split=10, block_n=16, block_k=256, num_warps=4, warm_counter=True)),  # fewer splits
    (DOWN_SILU_MAX_TOKENS, _ROWS(block_n=1, num_warps=4)),  # only when asked for: slower than split-K above 4 tokens
)


@functools.cache
def _resolved(config: DownSiluConfig, tokens: int) -> DownSiluConfig:
    """`config` with each field it leaves None taken from the default launch at `tokens`."""
    default = next(d for most, d in DEFAULTS if tokens <= most and config.whole_rows in (None, d.whole_rows))
    given = {f.name: v for f in dataclasses.fields(config) if (v := getattr(config, f.name)) is not None}
    return dataclasses.replace(default, **given)


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
    config = _resolved(config, t)
    if config.whole_rows:
        return _down_silu_whole_rows(x, weight, rank, scale, config)
    dot = t > 1  # multiply-adds are faster at one row only (docs/PERFORMANCE.md)
    block_m, block_n = max(16 if dot else 1, triton.next_power_of_2(t)), config.block_n
    if dot and block_n < 16:
        raise ValueError(f"down_silu: {t} rows take tl.dot, which needs blocks of 16 columns or more, got {block_n}")
    grid = (triton.cdiv(n, block_n), triton.cdiv(t, block_m), config.split)
    if grid[2] > 1 and counts.numel() < grid[0] * grid[1]:
        raise ValueError(f"down_silu: {counts.numel()} tile counters for {grid[0] * grid[1]} tiles")
    down, rest = x.new_empty(t, rank), x.new_empty(t, n - rank)
    part_stride = triton.cdiv(n, 16) * 16
    part = torch.empty(grid[2], t, part_stride, dtype=torch.float32, device=x.device) if grid[2] > 1 else down  # unused at 1
    _down_silu_kernel[grid](
        x, weight, down, rest, part, counts, t, k, n, x.stride(0), weight.stride(0), part_stride, rank, scale,
        SPLIT=grid[2], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=config.block_k, DOT=dot, UPCAST=x.device.type == "cpu",
        WARM_COUNTER=config.warm_counter, num_warps=config.num_warps, launch_pdl=launch_pdl(x),
    )  # fmt: skip
    return down, rest


def _down_silu_whole_rows(x: torch.Tensor, weight: torch.Tensor, rank: int, scale: float, config: DownSiluConfig):
    (t, k), n = x.shape, weight.shape[0]
    head = 1 << (k.bit_length() - 1)  # K = head + tail, the tail a masked power of two (0: none)
    tail = triton.next_power_of_2(k - head) if k > head else 0
    block = tail or head  # the head as head // block blocks of the tail's width
    down, rest = x.new_empty(t, rank), x.new_empty(t, n - rank)
    block_n, rows = config.block_n, min(triton.next_power_of_2(t), WHOLE_ROWS_PER_PROGRAM)
    _down_silu_rows_kernel[(triton.cdiv(n, block_n), triton.cdiv(t, rows))](
        x, weight, down, rest, t, k, n, x.stride(0), weight.stride(0), rank, scale, ROWS=rows,
        BLOCK_N=block_n, HEAD_ROWS=head // block, K_BLOCK=block, TAIL=tail > 0, num_warps=config.num_warps,
        launch_pdl=launch_pdl(x),
    )  # fmt: skip
    return down, rest
