"""One PLE layer's embedding table, or the contiguous row range of it that this ETP rank owns.

Stored INT8 + one bf16 scale per row (or BF16), on the accelerator or in host memory (pinned when
an accelerator exists, so the lookup kernel reads it over UVA). Checkpoint shards stream straight
into the final storage: no full-table temporary and no trip through the accelerator.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from qwen4_exp_hcu.ple.formats import dequantize_fp8_rows, dequantize_nvfp4_rows, row_width, table_format
from qwen4_exp_hcu.ple.int8 import dequantize_rows, quantize_rows, validate_int8_weight, validate_scale


def _pinned_empty(shape, dtype) -> torch.Tensor:
    """Host memory of exactly the table's size, page-locked and mapped for the accelerator (UVA).
    torch's pinned allocator rounds every block up to a power of two (a 12 GB table would take 16 GB),
    so the table registers an ordinary allocation instead, and unregisters it before it is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = np.empty(max(nbytes, 1), dtype=np.uint8)
    ptr = buf.ctypes.data
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, buf.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"registering {buf.nbytes} bytes of PLE table as pinned host memory failed ({err}).")
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)  # runs before numpy frees the buffer
    return torch.from_numpy(buf)[:nbytes].view(dtype).view(shape)


def gather_dequant_reference(ids, weight, scale, start: int, global_scale=None) -> torch.Tensor:
    """Torch reference of the fused kernel: [T, H] ids -> [T, H*d] bf16, zeros for rows not owned.
    The row format follows the storage dtypes (`ple.formats.table_format`)."""
    fmt = table_format(weight, scale)
    n, d = weight.shape[0], row_width(weight, fmt)
    local = ids.long() - start
    owned = (local >= 0) & (local < n)
    if n == 0:
        return torch.zeros(*ids.shape[:-1], ids.shape[-1] * d, dtype=torch.bfloat16, device=ids.device)
    rows = local.clamp(0, n - 1).reshape(-1)
    if fmt == "bf16":
        vals = weight[rows]
    elif fmt == "int8":
        vals = dequantize_rows(weight[rows], scale[rows])
    elif fmt == "fp8":
        vals = dequantize_fp8_rows(weight[rows], scale)
    else:
        vals = dequantize_nvfp4_rows(weight[rows], scale[rows], global_scale)
    vals = vals.view(*local.shape, d)
    vals = torch.where(owned[..., None], vals, torch.zeros((), dtype=torch.bfloat16, device=vals.device))
    return vals.flatten(-2)


class PLETable:
    """Rows ``[start, end)`` of a ``[rows, dim]`` table; `lookup` maps [T, H] row ids to [T, H*dim] bf16."""

    # kernel settings measured on an H200 (benchmarks/bench_lookup.py; README "Performance")
    DEVICE_TUNING = dict(block_p=16, num_warps=4)
    HOST_TUNING = dict(block_p=8, num_warps=8, sort=True)

    def __init__(
        self,
        rows: int,
        dim: int,
        *,
        start: int = 0,
        end: int | None = None,
        quantized: bool = True,
        device: torch.device | str = "cpu",
        host: bool = False,
        shard_rows: int | None = None,
    ):
        end = rows if end is None else end
        if not 0 <= start <= end <= rows:
            raise ValueError(f"PLE table row range [{start}, {end}) is not inside the table's {rows} rows.")
        self.rows, self.dim, self.start, self.end = rows, dim, start, end
        self.shard_rows = shard_rows or rows
        self.compute_device = torch.device(device)
        pin = host and torch.cuda.is_available()
        if host and self.compute_device.type != "cpu" and not pin:
            raise ValueError("host-resident PLE tables need UVA (pinned host memory) on the accelerator.")
        n = end - start
        wdtype = torch.int8 if quantized else torch.bfloat16
        if pin:
            self.weight = _pinned_empty((n, dim), wdtype)
            self.scale = _pinned_empty((n, 1), torch.bfloat16) if quantized else None
        else:
            where = torch.device("cpu") if host else self.compute_device
            self.weight = torch.empty(n, dim, dtype=wdtype, device=where)
            self.scale = torch.empty(n, 1, dtype=torch.bfloat16, device=where) if quantized else None
        self._loaded: set[int] = set()
        self.cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.quantized else 0)

    def describe(self) -> str:
        where = "pinned host" if self.weight.is_pinned() else str(self.weight.device)
        kind = "int8+bf16 scale" if self.quantized else "bf16"
        return f"rows [{self.start}, {self.end}) x {self.dim} {kind} in {where}: {self.nbytes / 2**20:.2f} MiB"

    # ---- loading -------------------------------------------------------------------------------
    def _shard_span(self, j: int) -> tuple[int, int]:
        lo = j * self.shard_rows
        return lo, min(lo + self.shard_rows, self.rows)

    def expected_shards(self) -> list[int]:
        """Checkpoint shards holding at least one owned row."""
        n_shards = -(-self.rows // self.shard_rows)
        return [j for j in range(n_shards) if max(self._shard_span(j)[0], self.start) < min(self._shard_span(j)[1], self.end)]

    def load_shard(self, j: int, weight: torch.Tensor, scale: torch.Tensor | None = None, name: str = "shard") -> None:
        """Copy the owned rows of checkpoint shard `j` (BF16, or INT8 with its scale) into storage."""
        lo, hi = self._shard_span(j)
        n = max(hi - lo, 0)
        if scale is None:
            if weight.dtype == torch.int8:
                raise ValueError(f"{name}: int8 weight without its weight_scale.")
            if tuple(weight.shape) != (n, self.dim):
                raise ValueError(f"{name}: shape {tuple(weight.shape)}, expected {(n, self.dim)}.")
        else:
            validate_int8_weight(weight, n, self.dim, name)
            validate_scale(scale, n, f"{name}_scale")
        a, b = max(lo, self.start), min(hi, self.end)
        if a < b:
            w = weight[a - lo : b - lo]
            s = None if scale is None else scale[a - lo : b - lo]
            dst = slice(a - self.start, b - self.start)
            if self.quantized and s is None:
                w, s = quantize_rows(w)
            elif not self.quantized and s is not None:
                w, s = dequantize_rows(w, s), None
            self.weight[dst].copy_(w)
            if s is not None:
                self.scale[dst].copy_(s)
        self._loaded.add(j)

    def check_loaded(self, name: str = "PLE table") -> None:
        missing = sorted(set(self.expected_shards()) - self._loaded)
        if missing:
            raise ValueError(f"{name}: checkpoint shards {missing} were never loaded (missing PLE shard).")

    # ---- hot-row cache ---------------------------------------------------------------------------
    def cache_hot_rows(self, calibration_ids: torch.Tensor, max_rows: int) -> float:
        """Keep the `max_rows` most frequent owned rows of a calibration id stream in accelerator memory
        (plus an int32 row->slot map over the owned rows); returns the share of calibration lookups they
        serve. Only for host tables: the lookup kernel checks the cache and skips host memory on a hit."""
        if self.weight.device == self.compute_device:
            raise ValueError("a hot-row cache only helps a host-resident PLE table.")
        n = self.end - self.start
        local = calibration_ids.flatten().long().cpu() - self.start
        counts = torch.bincount(local[(local >= 0) & (local < n)], minlength=n)
        top = counts.topk(min(max_rows, int((counts > 0).sum()))).indices
        cmap = torch.full((n,), -1, dtype=torch.int32)
        cmap[top] = torch.arange(len(top), dtype=torch.int32)
        dev = self.compute_device
        scale = None if self.scale is None else self.scale[top].to(dev)
        self.cache = (cmap.to(dev), self.weight[top].to(dev), scale)
        return float(counts[top].sum() / counts.sum().clamp_min(1))

    # ---- lookup --------------------------------------------------------------------------------
    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] int64 row ids -> [T, H*dim] bf16 (zeros where a row is not owned), into `out` if given."""
        shape = (ids.shape[0], ids.shape[1] * self.dim)
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16, device=ids.device)
        elif tuple(out.shape) != shape or out.dtype != torch.bfloat16 or out.device != ids.device or not out.is_contiguous():
            raise ValueError(
                f"lookup out must be a contiguous bf16 {shape} tensor on {ids.device}, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}."
            )
        if ids.device.type == "cpu":
            return out.copy_(gather_dequant_reference(ids, self.weight, self.scale, self.start))
        from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant

        tuning = self.DEVICE_TUNING if self.weight.device == self.compute_device else self.HOST_TUNING
        return gather_dequant(ids.contiguous(), self.weight, self.scale, self.start, out, cache=self.cache, **tuning)
