"""One PLE layer's embedding table, or the contiguous row range of it that this ETP rank owns.

Stored as BF16, INT8 + one bf16 scale per row, or upstream's FP8 / NVFP4 layouts (`ple.formats`), on the
accelerator or in host memory (pinned when an accelerator exists, so the lookup kernel reads it over UVA;
optionally one copy per node shared by the DP replicas, `tiers.host_memory`). Checkpoint shards stream straight
into the final storage: no full-table temporary and no trip through the accelerator.
"""

from __future__ import annotations

import weakref

import torch

from qwen4_exp_hcu.kernels import dispatch
from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant, gather_dequant_reference
from qwen4_exp_hcu.ple.formats.int8 import dequantize_rows, quantize_rows, validate_int8_weight, validate_scale
from qwen4_exp_hcu.ple.formats.rows import FORMATS, TableFormat, check_hot_rows, stored_as
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.tiers.file_rows import FileRows, excluded_settings
from qwen4_exp_hcu.ple.tiers.host_memory import huge_page_empty, pinned_empty
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows


def _source_format(weight: torch.Tensor, name: str) -> TableFormat:
    """The format a checkpoint shard is written in, from its weight's dtype (float32 rows load as BF16)."""
    fmt = FORMATS["bf16"] if weight.dtype == torch.float32 else stored_as(weight.dtype)
    if fmt is None:
        raise ValueError(f"{name}: a PLE table shard cannot be {weight.dtype}.")
    return fmt


def _table_format(name: str, dim: int) -> TableFormat:
    if name not in FORMATS:
        raise ValueError(f"PLE table format {name!r} is not one of {tuple(FORMATS)}.")
    FORMATS[name].check_width(dim)
    return FORMATS[name]


def _file_rows(storage: PLEStorage, start: int, n: int, shard_rows: int, row_bytes: int, allocate) -> FileRows:
    """The file tier over owned rows `[start, start + n)`, its buffers from `allocate`."""
    excluded = excluded_settings(storage)
    if excluded:
        raise ValueError(f"PLE rows from files keep their resident rows in private 4 KiB host pages with their scales: "
                         f"not with {', '.join(excluded)}.")  # fmt: skip
    return FileRows(storage.file_tier, start, n, shard_rows, row_bytes, allocate)


def _weakly(method):
    """`method` called through a weak reference to its object: the file tier grows its staging through its table's
    allocator, and a strong one would make table and tier a cycle that only the cycle collector frees (with the
    table's maps and pinned staging)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def _validate_packed(fmt: TableFormat, packed: torch.Tensor, block_scale: torch.Tensor | None, rows: int, dim: int,
                     name: str) -> None:  # fmt: skip
    """A shard of a format with block scales (NVFP4) against the table's shape."""
    upper, want = fmt.name.upper(), fmt.weight_shape(rows, dim)
    if tuple(packed.shape) != want:
        raise ValueError(f"{name}: packed {upper} shape {tuple(packed.shape)}, expected {want}.")
    want, dtype = fmt.row_scale.shape(rows, dim), getattr(torch, fmt.row_scale.dtype)
    if block_scale is None or block_scale.dtype != dtype or tuple(block_scale.shape) != want:
        got = None if block_scale is None else (block_scale.dtype, tuple(block_scale.shape))
        raise ValueError(f"{name}_scale: expected {fmt.row_scale.dtype} block scales of shape {want}, got {got}.")


class PLETable:
    """Rows ``[start, end)`` of a ``[rows, dim]`` table; `lookup` maps [T, H] row ids to [T, H*dim] bf16.

    `storage.format` (`format` here is its `ple.formats` record): `bf16`, `int8` (+ one bf16
    scale per row), `fp8` (e4m3 + one fp32 scale for the table) or `nvfp4` (packed e2m1 + e4m3 block scales +
    one fp32 scale). Rows live on the accelerator or in host memory (`storage.host`); per-row scales live with
    them unless `storage.scales_on_device`; the one-number scale always lives on the accelerator. A checkpoint
    shard holds `shard_rows` rows (default: all)."""

    # kernel settings measured on an H200 (benchmarks/bench_lookup.py; docs/PERFORMANCE.md). Host rows: 4 rows a
    # program ties 8 on 12-13 GB tables and reads the 52 GB TP1 table 1.26x faster
    DEVICE_TUNING = dict(block_p=16, num_warps=4)
    HOST_TUNING = dict(block_p=4, num_warps=8, sort=True)

    def __init__(
        self, rows: int, dim: int, storage: PLEStorage = PLEStorage(), *, start: int = 0, end: int | None = None,
        shard_rows: int | None = None,
    ):  # fmt: skip
        end = rows if end is None else end
        if not 0 <= start <= end <= rows:
            raise ValueError(f"PLE table row range [{start}, {end}) is not inside the table's {rows} rows.")
        self.format = _table_format(storage.format or "bf16", dim)
        self.rows, self.dim, self.start, self.end = rows, dim, start, end
        self.shard_rows = shard_rows or rows
        self.compute_device = torch.device(storage.device)
        self.shared = storage.shared  # the DP replicas on this node map one copy; its first rank fills it
        self.pages = "4k"  # host pages: "4k", "thp" or "hugetlb"
        self._alloc = self._allocator(storage)
        self._scale_alloc = self._on_device if storage.scales_on_device else self._alloc
        self.file_rows: FileRows | None = None  # rows beyond host RAM stay in the checkpoint's files (`file_rows`)
        if storage.file_tier is None:
            self._allocate(end - start)
        else:
            self.file_rows = _file_rows(storage, start, end - start, self.shard_rows, self.format.row_bytes(dim), _weakly(self._allocate))
        self._scale_name: str | None = None  # one fp32 scale for the whole table (`set_table_scale`)
        self.tensor_scale = (
            torch.full((1,), float("nan"), dtype=torch.float32, device=self.compute_device) if self.format.table_scale else None
        )
        self._loaded: set[int] = set()
        self.hot: HotRows | None = None  # GPU cache of the most used rows (`enable_hot_rows`)

    def _allocator(self, storage: PLEStorage):
        """How the per-row buffers are allocated: in the DP-shared host copy, on 2 MiB host pages, pinned (read by an
        accelerator over UVA), or plainly on the table's device."""
        host, pin = storage.host, storage.host and torch.cuda.is_available()
        if host and self.compute_device.type != "cpu" and not pin:
            raise ValueError("host-resident PLE tables need UVA (pinned host memory) on the accelerator.")
        if self.shared is not None and not host:
            raise ValueError("dp_shared_memory shares host-resident PLE tables; this table is on the accelerator.")
        if self.shared is not None:
            return lambda shape, dtype, part: self.shared.empty(part, shape, dtype)
        if host and storage.huge_pages:
            return self._huge_page_empty
        if pin:
            return lambda shape, dtype, part: pinned_empty(shape, dtype)
        where = torch.device("cpu") if host else self.compute_device
        return lambda shape, dtype, part: torch.empty(shape, dtype=dtype, device=where)

    def _on_device(self, shape, dtype, part) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.compute_device)

    def _huge_page_empty(self, shape, dtype, part) -> torch.Tensor:
        tensor, self.pages = huge_page_empty(shape, dtype, f"PLE table rows [{self.start}, {self.end}) {part}")
        return tensor

    def _allocate(self, rows: int, keep: int = 0) -> dict[str, torch.Tensor]:
        """(Re)allocate the per-row buffers for `rows` rows, keeping the first `keep` (the file tier's staging grows)."""
        old = self._parts() if keep else {}
        fmt = self.format
        self.weight = self._alloc(fmt.weight_shape(rows, self.dim), getattr(torch, fmt.weight), "weight")
        scale = fmt.row_scale
        self.scale = None if scale is None else self._scale_alloc(scale.shape(rows, self.dim), getattr(torch, scale.dtype), "scale")
        for part, t in self._parts().items():
            if part in old:
                t[:keep].copy_(old[part][:keep])
        return self._parts()

    def _parts(self) -> dict[str, torch.Tensor]:
        """The per-row buffers by checkpoint part."""
        return {"weight": self.weight} | ({"weight_scale": self.scale} if self.scale is not None else {})

    @property
    def quantized(self) -> bool:
        return self.format.name != "bf16"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.weight, self.scale, self.tensor_scale) if t is not None)

    def describe(self) -> str:
        where = "pinned host" if self.weight.is_pinned() else str(self.weight.device)
        if self.weight.device.type == "cpu" and self.pages != "4k":
            where += f" ({self.pages} 2 MiB pages)"
        if self.scale is not None and self.scale.device != self.weight.device:
            where += f", scales on {self.scale.device}"
        hot = "" if self.hot is None else f"; {self.hot.describe()}"
        hot += "" if self.file_rows is None else f"; {self.file_rows.describe()}"
        return f"rows [{self.start}, {self.end}) x {self.dim} {self.format.label} in {where}: {self.nbytes / 2**20:.2f} MiB{hot}"

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
        source = _source_format(weight, name)
        src = source.name
        if src != self.format.name and {src, self.format.name} != {"bf16", "int8"}:
            raise ValueError(
                f"{name}: a {weight.dtype} shard in a table the checkpoint's config declares {self.format.name} "
                "(the config and the tensors disagree)."
            )
        if source.row_scale is None and scale is not None:
            raise ValueError(f"{name}: a {weight.dtype} weight takes no per-shard weight_scale.")
        if source.row_scale is None and tuple(weight.shape) != source.weight_shape(n, self.dim):
            raise ValueError(f"{name}: shape {tuple(weight.shape)}, expected {source.weight_shape(n, self.dim)}.")
        if src == "int8":
            if scale is None:
                raise ValueError(f"{name}: int8 weight without its weight_scale.")
            validate_int8_weight(weight, n, self.dim, name)
            validate_scale(scale, n, f"{name}_scale")
        elif source.row_scale is not None:
            _validate_packed(source, weight, scale, n, self.dim, name)
        a, b = max(lo, self.start), min(hi, self.end)
        if self.file_rows is not None:  # the rows stay in the file; lookups read them there
            if src != self.format.name:
                raise ValueError(f"{name}: PLE rows from files are read as stored ({src}), but the table is {self.format.name}.")
            if a < b:
                self.file_rows.add_shard(j, {part: f"{name}{part.removeprefix('weight')}" for part in self._parts()})
        elif a < b and (self.shared is None or self.shared.writer):  # a shared table is filled once
            w = weight[a - lo : b - lo]
            s = None if scale is None else scale[a - lo : b - lo]
            dst = slice(a - self.start, b - self.start)
            if self.format.name == "int8" and src == "bf16":
                w, s = quantize_rows(w)
            elif self.format.name == "bf16" and src == "int8":
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
            raise ValueError(f"{name}: a table-level scale in a table the checkpoint's config declares {self.format.name} (none has one).")
        if not value.is_floating_point() or value.numel() != 1 or value.dim() > 1:
            raise ValueError(f"{name}: expected one floating-point scale of shape [1] or [], got {value.dtype} {tuple(value.shape)}.")
        scale = value.reshape(1).to(getattr(torch, self.format.table_scale_dtype)).float()
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
            raise ValueError(f"{name}.{self.format.table_scale} is missing: a {self.format.name} PLE table needs its one table-level scale.")
        if self.shared is not None:
            self.shared.loaded()
        if self.file_rows is not None:
            self.file_rows.loaded()

    # ---- hot-row cache ---------------------------------------------------------------------------
    def enable_hot_rows(self, slots: int, observe: bool = False) -> HotRows:
        """A GPU cache of `slots` owned rows, empty until filled (`hot.fill(calibration ids)`) or, with
        `observe`, refreshed from the rows this table's lookups read (see `tiers.hot_rows`)."""
        if self.weight.device == self.compute_device:
            raise ValueError("a hot-row cache only helps a host-resident PLE table read by an accelerator.")
        check_hot_rows(self.format.name)
        weight, scale = self.weight, self.scale
        if self.file_rows is not None:  # in front of the file tier: newcomers come from the files
            weight = self.file_rows.mapped("weight")
            scale = None if scale is None else self.file_rows.mapped("weight_scale")
        self.hot = HotRows(weight, scale, self.start, slots, self.compute_device, observe)
        return self.hot

    def fill_resident_rows(self, ids: torch.Tensor) -> float:
        """The file tier's resident rows from calibration row ids, less those a GPU hot-row cache serves (host
        memory then takes the next most frequent); the share of the remaining owned lookups they serve."""
        if self.hot is not None:
            ids = ids.reshape(-1)[self.hot.slots_of(ids) < 0]
        return self.file_rows.fill(ids)

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
        cache, start, by_pair = None, self.start, False
        if self.hot is not None:  # only on an accelerator (`enable_hot_rows`)
            self.hot.observe(ids)
            cache = self.hot.tensors
        if self.file_rows is not None:  # the misses staged by a host function in stream order (captured by CUDA graphs)
            if cache is not None:  # staged ids are buffer rows: the cache is consulted per (token, head)
                slots = self.hot.slots_of(ids)
                cache, by_pair = (slots, *cache[1:]), True
                ids = self.file_rows.stage(ids, cached=slots.view(ids.shape) >= 0)
            else:
                ids = self.file_rows.stage(ids)
            start = 0
        # the kernel takes the row scales (+ the table scale), or a table scale alone in their place
        scale, global_scale = (self.scale, self.tensor_scale) if self.scale is not None else (self.tensor_scale, None)
        tuning = self.DEVICE_TUNING if self.weight.device == self.compute_device else self.HOST_TUNING
        out = dispatch(
            gather_dequant, gather_dequant_reference, ids.contiguous(), self.weight, scale, start, out=out,
            global_scale=global_scale, **self.format.kernel_args, options=dict(cache=cache, cache_by_pair=by_pair, **tuning),
        )
        if self.file_rows is not None:
            self.file_rows.lookup_done(self.compute_device)
        return out
