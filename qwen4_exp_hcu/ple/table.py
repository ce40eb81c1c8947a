"""One PLE layer's embedding table, or the contiguous row range of it that this ETP rank owns.

Stored as BF16, INT8 + one bf16 scale per row, or upstream's FP8 / NVFP4 layouts (`ple.formats`), on the
accelerator or in host memory (pinned when an accelerator exists, so the lookup kernel reads it over UVA;
optionally one copy per node shared by the DP replicas, `ple.host_memory`). Checkpoint shards stream straight
into the final storage: no full-table temporary and no trip through the accelerator.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from qwen4_exp_hcu.names import TABLE_SCALE_PART
from qwen4_exp_hcu.ple.formats import NVFP4_BLOCK, dequantize_fp8_rows, dequantize_nvfp4_rows, row_width, table_format
from qwen4_exp_hcu.ple.host_memory import SharedHost
from qwen4_exp_hcu.ple.hot_rows import HotRows
from qwen4_exp_hcu.ple.int8 import dequantize_rows, quantize_rows, validate_int8_weight, validate_scale


def _pinned_empty(shape, dtype) -> torch.Tensor:
    """Host memory of exactly the table's size, page-locked and mapped for the accelerator (UVA).
    torch's pinned allocator rounds every block up to a power of two (a 12 GB table would take 16 GB),
    so the table registers an ordinary allocation instead, and unregisters it before it is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = np.empty(max(nbytes, 1), dtype=np.uint8)
    pin(buf.ctypes.data, buf.nbytes, buf)
    return torch.from_numpy(buf)[:nbytes].view(dtype).view(shape)


def pin(ptr: int, nbytes: int, owner) -> None:
    """Register host memory for the accelerator (UVA) until `owner` is freed."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"registering {nbytes} bytes of PLE table as pinned host memory failed: error {int(err)}, "
                           f"{cudart.cudaGetErrorString(err)}.")
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)  # runs before the memory is released


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


def _source_format(weight: torch.Tensor, name: str) -> str:
    """The format a checkpoint shard is written in, from its weight's dtype."""
    by_dtype = {torch.bfloat16: "bf16", torch.float32: "bf16", torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "nvfp4"}
    if weight.dtype not in by_dtype:
        raise ValueError(f"{name}: a PLE table shard cannot be {weight.dtype}.")
    return by_dtype[weight.dtype]


def _validate_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor | None, rows: int, dim: int, name: str) -> None:
    if tuple(packed.shape) != (rows, dim // 2):
        raise ValueError(f"{name}: packed NVFP4 shape {tuple(packed.shape)}, expected {(rows, dim // 2)}.")
    want = (rows, dim // NVFP4_BLOCK)
    if block_scale is None or block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != want:
        got = None if block_scale is None else (block_scale.dtype, tuple(block_scale.shape))
        raise ValueError(f"{name}_scale: expected float8_e4m3fn block scales of shape {want}, got {got}.")


_WEIGHT_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}
FORMATS = tuple(_WEIGHT_DTYPES)


class PLETable:
    """Rows ``[start, end)`` of a ``[rows, dim]`` table; `lookup` maps [T, H] row ids to [T, H*dim] bf16.

    `fmt` is the storage format (`ple.formats`): `bf16`, `int8` (+ one bf16 scale per row), `fp8` (e4m3 +
    one fp32 scale for the table) or `nvfp4` (packed e2m1 + e4m3 block scales + one fp32 scale). Rows
    live on the accelerator or in host memory (`host`; on 2 MiB pages with `huge_pages`); per-row scales live
    with them unless `scales_on_device` keeps them on the accelerator (one host read per row instead of two);
    the one-number scale always lives on the accelerator."""

    # kernel settings measured on an H200 (benchmarks/bench_lookup.py; docs/PERFORMANCE.md)
    DEVICE_TUNING = dict(block_p=16, num_warps=4)
    HOST_TUNING = dict(block_p=8, num_warps=8, sort=True)

    def __init__(
        self,
        rows: int,
        dim: int,
        *,
        start: int = 0,
        end: int | None = None,
        fmt: str = "int8",
        device: torch.device | str = "cpu",
        host: bool = False,
        shard_rows: int | None = None,
        shared: SharedHost | None = None,
        huge_pages: bool = False,
        scales_on_device: bool = False,
    ):
        end = rows if end is None else end
        if not 0 <= start <= end <= rows:
            raise ValueError(f"PLE table row range [{start}, {end}) is not inside the table's {rows} rows.")
        if fmt not in FORMATS:
            raise ValueError(f"PLE table format {fmt!r} is not one of {FORMATS}.")
        if fmt == "nvfp4" and dim % NVFP4_BLOCK:
            raise ValueError(f"NVFP4 PLE rows hold blocks of {NVFP4_BLOCK} values; the head dim {dim} is not a multiple.")
        self.rows, self.dim, self.start, self.end, self.fmt = rows, dim, start, end, fmt
        self.shard_rows = shard_rows or rows
        self.compute_device = torch.device(device)
        pin = host and torch.cuda.is_available()
        if host and self.compute_device.type != "cpu" and not pin:
            raise ValueError("host-resident PLE tables need UVA (pinned host memory) on the accelerator.")
        if shared is not None and not host:
            raise ValueError("dp_shared_memory shares host-resident PLE tables; this table is on the accelerator.")
        self.shared = shared  # the DP replicas on this node map one copy; its first rank fills it
        where = torch.device("cpu") if host else self.compute_device
        self.pages = "4k"  # host pages: "4k", "thp" or "hugetlb"
        on_device = lambda shape, dtype, name: torch.empty(shape, dtype=dtype, device=self.compute_device)  # noqa: E731
        if shared is not None:
            alloc = lambda shape, dtype, name: shared.empty(name, shape, dtype)  # noqa: E731
        elif host and huge_pages:
            alloc = self._huge_page_alloc
        elif pin:
            alloc = lambda shape, dtype, name: _pinned_empty(shape, dtype)  # noqa: E731
        else:
            alloc = lambda shape, dtype, name: torch.empty(shape, dtype=dtype, device=where)  # noqa: E731
        n = end - start
        self.weight = alloc((n, dim // 2 if fmt == "nvfp4" else dim), _WEIGHT_DTYPES[fmt], "weight")
        row_scale = {"int8": ((n, 1), torch.bfloat16), "nvfp4": ((n, dim // NVFP4_BLOCK), torch.float8_e4m3fn)}
        scale_alloc = on_device if scales_on_device else alloc
        self.scale = scale_alloc(*row_scale[fmt], "scale") if fmt in row_scale else None
        # fp8 / nvfp4: one fp32 scale for the whole table (`set_table_scale`)
        self._scale_name: str | None = None
        self.tensor_scale = (
            torch.full((1,), float("nan"), dtype=torch.float32, device=self.compute_device) if fmt in ("fp8", "nvfp4") else None
        )
        self._loaded: set[int] = set()
        self.hot: HotRows | None = None  # GPU cache of the most used rows (`enable_hot_rows`)

    def _huge_page_alloc(self, shape, dtype, name) -> torch.Tensor:
        from qwen4_exp_hcu.ple.host_memory import huge_page_empty

        tensor, self.pages = huge_page_empty(shape, dtype, f"PLE table rows [{self.start}, {self.end}) {name}")
        return tensor

    @property
    def quantized(self) -> bool:
        return self.fmt != "bf16"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.scale, self.tensor_scale) if t is not None)

    def describe(self) -> str:
        where = "pinned host" if self.weight.is_pinned() else str(self.weight.device)
        if self.weight.device.type == "cpu" and self.pages != "4k":
            where += f" ({self.pages} 2 MiB pages)"
        if self.scale is not None and self.scale.device != self.weight.device:
            where += f", scales on {self.scale.device}"
        kind = {"bf16": "bf16", "int8": "int8+bf16 scale", "fp8": "fp8 e4m3+table scale",
                "nvfp4": "nvfp4 e2m1+e4m3 block scales+table scale"}[self.fmt]  # fmt: skip
        hot = "" if self.hot is None else f"; {self.hot.describe()}"
        return f"rows [{self.start}, {self.end}) x {self.dim} {kind} in {where}: {self.nbytes / 2**20:.2f} MiB{hot}"

    # ---- loading -------------------------------------------------------------------------------
    def _shard_span(self, j: int) -> tuple[int, int]:
        lo = j * self.shard_rows
        return lo, min(lo + self.shard_rows, self.rows)

    def expected_shards(self) -> list[int]:
        """Checkpoint shards holding at least one owned row."""
        n_shards = -(-self.rows // self.shard_rows)
        return [j for j in range(n_shards) if max(self._shard_span(j)[0], self.start) < min(self._shard_span(j)[1], self.end)]

    def load_shard(self, j: int, weight: torch.Tensor, scale: torch.Tensor | None = None, name: str = "shard") -> None:
        """Copy the owned rows of checkpoint shard `j` into storage: BF16 (quantized to INT8 when stored
        so), INT8 with its row scales (dequantized when stored as BF16), FP8 alone (its scale is the
        table's, `set_table_scale`), NVFP4 with its block scales (`scale`)."""
        lo, hi = self._shard_span(j)
        n = max(hi - lo, 0)
        src = _source_format(weight, name)
        if src != self.fmt and {src, self.fmt} != {"bf16", "int8"}:
            raise ValueError(
                f"{name}: a {weight.dtype} shard in a table the checkpoint's config declares {self.fmt} "
                "(the config and the tensors disagree)."
            )
        if src in ("bf16", "fp8") and scale is not None:
            raise ValueError(f"{name}: a {weight.dtype} weight takes no per-shard weight_scale.")
        if src in ("bf16", "fp8") and tuple(weight.shape) != (n, self.dim):
            raise ValueError(f"{name}: shape {tuple(weight.shape)}, expected {(n, self.dim)}.")
        if src == "int8":
            if scale is None:
                raise ValueError(f"{name}: int8 weight without its weight_scale.")
            validate_int8_weight(weight, n, self.dim, name)
            validate_scale(scale, n, f"{name}_scale")
        if src == "nvfp4":
            _validate_nvfp4(weight, scale, n, self.dim, name)
        a, b = max(lo, self.start), min(hi, self.end)
        if a < b and (self.shared is None or self.shared.writer):  # a shared table is filled once
            w = weight[a - lo : b - lo]
            s = None if scale is None else scale[a - lo : b - lo]
            dst = slice(a - self.start, b - self.start)
            if self.fmt == "int8" and src == "bf16":
                w, s = quantize_rows(w)
            elif self.fmt == "bf16" and src == "int8":
                w, s = dequantize_rows(w, s), None
            self.weight[dst].copy_(w)
            if s is not None:
                self.scale[dst].copy_(s)
        self._loaded.add(j)

    def set_table_scale(self, value: torch.Tensor, name: str) -> None:
        """The one scale of an FP8 (`weight_scale`) or NVFP4 (`weight_scale_2`) table, as upstream stores it:
        one finite positive number of any float dtype, shape [1] or []. FP8 rows are multiplied in bf16 by
        the bf16-rounded scale, as upstream dequantizes them (exact for the releases' bf16 scale); NVFP4 in fp32."""
        if self.tensor_scale is None:
            raise ValueError(f"{name}: a table-level scale in a table the checkpoint's config declares {self.fmt} (none has one).")
        if not value.is_floating_point() or value.numel() != 1 or value.dim() > 1:
            raise ValueError(f"{name}: expected one floating-point scale of shape [1] or [], got {value.dtype} {tuple(value.shape)}.")
        scale = value.reshape(1).to(torch.bfloat16 if self.fmt == "fp8" else torch.float32).float()
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise ValueError(f"{name}: the table scale must be finite and positive, got {value.item()}.")
        if self._scale_name is not None:
            raise ValueError(f"{name}: the table scale arrived twice (first as {self._scale_name}).")
        self.tensor_scale.copy_(scale.to(self.tensor_scale.device))
        self._scale_name = name

    def check_loaded(self, name: str = "PLE table") -> None:
        missing = sorted(set(self.expected_shards()) - self._loaded)
        if missing:
            raise ValueError(f"{name}: checkpoint shards {missing} were never loaded (missing PLE shard).")
        if self.tensor_scale is not None and self._scale_name is None:
            raise ValueError(f"{name}.{TABLE_SCALE_PART[self.fmt]} is missing: a {self.fmt} PLE table needs its one table-level scale.")
        if self.shared is not None:
            self.shared.loaded()

    # ---- hot-row cache ---------------------------------------------------------------------------
    def enable_hot_rows(self, slots: int, observe: bool = False) -> HotRows:
        """A GPU cache of `slots` owned rows, empty until filled (`hot.fill(calibration ids)`) or, with
        `observe`, refreshed from the rows this table's lookups read (see `ple.hot_rows`)."""
        if self.weight.device == self.compute_device:
            raise ValueError("a hot-row cache only helps a host-resident PLE table read by an accelerator.")
        if self.fmt not in ("bf16", "int8"):
            raise ValueError(f"the hot-row cache serves BF16 and INT8 PLE tables, not {self.fmt}.")
        self.hot = HotRows(self.weight, self.scale, self.start, self.end, slots, self.compute_device, observe)
        return self.hot

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
        # fp8 passes its table scale where the kernel takes a scale; nvfp4 its block scales + table scale
        scale, global_scale = (self.tensor_scale, None) if self.fmt == "fp8" else (self.scale, None)
        if self.fmt == "nvfp4":
            global_scale = self.tensor_scale
        if ids.device.type == "cpu":
            return out.copy_(gather_dequant_reference(ids, self.weight, scale, self.start, global_scale))
        from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant

        tuning = self.DEVICE_TUNING if self.weight.device == self.compute_device else self.HOST_TUNING
        cache = None
        if self.hot is not None:
            self.hot.observe(ids)
            cache = self.hot.tensors
        return gather_dequant(
            ids.contiguous(), self.weight, scale, self.start, out, global_scale=global_scale, cache=cache, **tuning
        )
