"""PLE rows beyond host RAM: a table whose rows stay in the checkpoint's safetensors files (memory-mapped, never
read whole), with the most-read rows resident in host memory (pinned on an accelerator).

The read path is a host gather: each lookup brings its ids to the host, copies the rows that are not
resident from the mapped files into a staging area, and hands the lookup kernel remapped ids over one
buffer that holds the resident rows followed by the staging area. The bytes are the checkpoint's, so lookups
are exact. Accelerators that read pageable host memory directly could skip the staging copy, but the H200
reports `cudaDevAttrPageableMemoryAccess` = 0 (docs/PERFORMANCE.md), so every platform
takes the host gather. On an accelerator it runs in the stream's order on the driver's host thread
(`ple.host_call`): the ids go to pinned memory, the host function (C, `ple/tiers/stage.c`: it needs no GIL) stages
the rows and writes the remapped ids to pinned memory, and they go back, all queued without a host sync. CUDA
graphs capture it as a host node, so it runs in full decode graphs too, and the lookup overlaps the previous
decoder layer.

Resident rows follow the traffic (row counts over every lookup; every `refresh_every` lookups the most
counted rows become resident, at most `promote_rows` newcomers at a time, and counts halve) or calibration ids
(`fill`), as the GPU hot-row cache does.
A GPU hot-row cache can sit in front (`PLETable.enable_hot_rows`): the rows it serves are neither staged nor
counted here, so host memory keeps the next most read rows, and it copies its newcomers from the files
(`MappedRows`).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qwen4_exp_hcu.ple.tiers import stager
from qwen4_exp_hcu.ple.tiers.host_call import HostCallStats, guarded, launch, launcher

REFRESH_EVERY = 256  # lookups between promotions of the most read rows
PROMOTE_ROWS = 4096  # newcomers a traffic promotion reads from the files at most (the most read first)
FRESH_ROWS = 1 << 20  # rows first read since the last promotion that bring the next one forward (8 MB of candidates)
# pinned per id of a lookup, shared with its host function: the id, the hot-row cache's flag, the buffer row
IO_DTYPES = {"ids": torch.int64, "cached": torch.bool, "slot": torch.int64}

# safetensors dtype codes -> bytes per element (the rows are moved as bytes)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip


@dataclass(frozen=True)
class TensorLocation:
    path: Path
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file

    @property
    def nbytes(self) -> int:
        return _ITEMSIZE[self.dtype] * int(np.prod(self.shape, dtype=np.int64))

    def rows(self) -> np.memmap:
        """[rows, bytes per row] read-only view of the file."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.shape[0], self.nbytes // self.shape[0]))


class CheckpointFiles:
    """Where every tensor of a checkpoint directory's safetensors files lies: file, dtype, shape, byte offset.
    The safetensors format is an 8-byte little-endian header length, a JSON header, then the data; the
    safetensors library reads tensors but does not expose their offsets, which a row gather needs. A file the
    index names that is missing, or a file shorter than its header says, is an error naming it."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [directory / n for n in names]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"PLE rows from files: {missing[0]} (named by {index}) does not exist.")
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"PLE rows from files: no safetensors files in {directory}.")
        self.tensors: dict[str, TensorLocation] = {}
        for f in files:
            self.tensors.update(_read_header(f))
        self._by_key: dict[str, list[TensorLocation]] = {}
        for n, loc in self.tensors.items():
            self._by_key.setdefault(_key(n), []).append(loc)

    def find(self, name: str) -> TensorLocation:
        """The tensor `name`, matched from its `layers.` part on (vLLM and the checkpoint prefix models differently)."""
        hits = self._by_key.get(_key(name), [])
        if len(hits) != 1:
            raise ValueError(f"PLE rows from files: {name} is {'not' if not hits else 'more than once'} in the safetensors files of {self.directory}.")
        return hits[0]


def _key(name: str) -> str:
    return name[name.index("layers.") :] if "layers." in name else name


def _read_header(path: Path) -> dict[str, TensorLocation]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"PLE rows from files: {path} is truncated (no safetensors header).")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"PLE rows from files: {path} is truncated (header of {n} bytes, file of {size}).")
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if 8 + n + end > size:
            raise ValueError(f"PLE rows from files: {path} is truncated: {name} ends at byte {8 + n + end}, the file has {size}.")
        out[name] = TensorLocation(path, info["dtype"], tuple(info["shape"]), 8 + n + begin)
    return out


@dataclass(frozen=True)
class FileTier:
    """The opt-in file tier of `PLEStorage`: the checkpoint's files and the host bytes per table for resident
    rows (`host_table_gib` over the PLE layers)."""

    files: CheckpointFiles
    resident_bytes: int
    refresh_every: int = REFRESH_EVERY  # 0: resident rows only from calibration (`fill`)
    promote_rows: int | None = PROMOTE_ROWS  # a promotion runs inside a lookup: its file reads (a page fault per row) stall it; None: no cap
    staging_rows: int = 4096  # rows a lookup reads from the files before the staging area grows (serving sizes it for its largest step)


class FileRows:
    """Owned rows `[start, start + n)` of a table of `row_bytes` per row. The table's per-row buffers
    (`resize(rows, keep)` allocates them, keeping the first `keep` rows) hold the resident rows the budget
    allows (`slots`), then the staging area."""

    def __init__(self, tier: FileTier, start: int, n: int, shard_rows: int, row_bytes: int, resize) -> None:
        self.tier, self.start, self.n, self.shard_rows = tier, start, n, shard_rows
        self.slots = slots = resident_slots(tier.resident_bytes, n, row_bytes)
        self.slot_of = np.full(n, -1, dtype=np.int32)  # owned row -> resident slot, -1: in the files
        self.slot_row = np.full(slots, -1, dtype=np.int32)  # resident slot -> owned row (a rank owns < 2**31 rows)
        self.counts = np.zeros(n, dtype=np.int32) if tier.refresh_every else None
        # the C host function's state (`ple/tiers/stage.c`); it counts each lookup's rows, and every `refresh_every`
        # lookups calls `_promote_from_traffic` over the rows counted from zero since (`_fresh`) and those whose
        # count survived the last halving (`_carried`): promotions never scan the table
        self._host_function = stager.host_function()  # built now: no C compiler fails at load
        self._state = state = stager.Stager(start=start, n=n, shard_rows=shard_rows, slots=slots, alive=1,
                                            slot_of=self.slot_of.ctypes.data)  # fmt: skip
        weakref.finalize(self, _retire, state)
        if self.counts is not None:
            self._fresh = np.empty(min(n, FRESH_ROWS), dtype=np.int64)
            self._carried = np.empty(0, dtype=np.int64)
            state.counts, state.fresh, state.fresh_cap = self.counts.ctypes.data, self._fresh.ctypes.data, self._fresh.size
            state.refresh_every = tier.refresh_every
            state.promote = guarded(self._promote_from_traffic, "PLE rows from files: promoting the most read rows")
        self.files: dict[int, dict[str, np.memmap]] = {}  # checkpoint shard -> part -> [shard rows, bytes]
        self._resize = resize
        self._set_buffers(resize(slots + tier.staging_rows))
        first = start // shard_rows
        self._src = np.zeros((max(0, (start + n - 1) // shard_rows - first + 1), len(self.buffers)), dtype=np.uintp)
        state.first_shard, state.n_parts, state.src = first, self._src.shape[1], self._src.ctypes.data
        self._clock = 0
        self._done = None
        self.refreshes, self.share = 0, 0.0
        self._io: dict[str, np.ndarray] = {}  # ids / cached / slots of a lookup (pinned on an accelerator), read by C
        self._io_tensors: dict[str, torch.Tensor] = {}
        self._captured = False  # a CUDA graph holds the buffers' addresses: they can no longer be reallocated
        self._calls: dict[tuple[int, bool], int] = {}  # (ids, flagged) -> address of the host node's argument

    def _set_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """The per-row buffers, and their bytes as numpy arrays: what the host function writes (no torch there)."""
        self.buffers = buffers
        self._bytes = {part: byte_rows(t) for part, t in buffers.items()}
        self._dst = np.array([b.ctypes.data for b in self._bytes.values()], dtype=np.uintp)
        self._row_bytes = np.array([b.shape[1] for b in self._bytes.values()], dtype=np.int64)
        self._state.dst, self._state.row_bytes = self._dst.ctypes.data, self._row_bytes.ctypes.data

    @property
    def staging(self) -> int:
        return next(iter(self.buffers.values())).shape[0] - self.slots

    def add_shard(self, j: int, parts: dict[str, str]) -> None:
        """Map checkpoint shard `j`'s per-row tensors (`part -> tensor name`); shapes must fit the table."""
        for part, name in parts.items():
            mm = self.tier.files.find(name).rows()
            want = self.buffers[part][0].nbytes
            if mm.shape[1] != want:
                raise ValueError(f"{name}: {mm.shape[1]} bytes per row in the file, the table stores {want}.")
            self.files.setdefault(j, {})[part] = mm
            self._src[j - self._state.first_shard, list(self.buffers).index(part)] = mm.ctypes.data

    def loaded(self) -> None:
        """After the shards are mapped (each one that holds owned rows, else an error naming it): a budget that holds
        every owned row makes them all resident now."""
        unmapped = np.flatnonzero((self._src == 0).any(axis=1))
        if unmapped.size:
            raise ValueError(f"PLE rows from files: checkpoint shard {self._state.first_shard + int(unmapped[0])} of the "
                             f"table's rows was not found in {self.tier.files.directory}.")  # fmt: skip
        if self.slots == self.n:
            every = np.arange(self.n)
            self._read(every, 0)
            self.slot_of[:], self.slot_row[:] = every, every
        if next(iter(self.buffers.values())).is_pinned():  # read by an accelerator: its pinned ids now, not mid-capture
            launcher()
            self._reserve(self.staging, torch.device("cuda"))

    def _read(self, rows: np.ndarray, at: int, into: dict[str, np.ndarray] | None = None) -> None:
        """Copy owned rows from the files into buffer rows `at...` (or into the per-row byte arrays `into`)."""
        if not rows.size:  # a refresh with no newcomer
            return
        glob = rows + self.start
        shard = glob // self.shard_rows
        starts = np.flatnonzero(np.diff(shard, prepend=-1))  # one run of rows per checkpoint shard
        dst = self._bytes if into is None else into
        for a, b in zip(starts.tolist(), [*starts[1:].tolist(), rows.size]):
            j = int(shard[a])
            for part in dst:
                np.take(self.files[j][part], glob[a:b] - j * self.shard_rows, axis=0, out=dst[part][at + a : at + b])

    def _wait(self) -> None:
        """Before the main thread rewrites the buffers: the last lookup (its host function and kernel) is done."""
        if self._done is not None:
            self._done.synchronize()

    def lookup_done(self, device: torch.device) -> None:
        """After a lookup's kernel: the next lookup's host function waits for it (on the GPU, not the host)."""
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()

    def _reserve(self, n: int, device: torch.device) -> None:
        """Staging and a lookup's ids and slots (pinned on an accelerator) for `n` row ids. Serving sizes them at
        start-up for its largest step; growing re-pins host memory, which no CUDA graph may capture."""
        io_rows = len(self._io["ids"]) if self._io else 0
        if n <= self.staging and n <= io_rows:
            return
        # a table an accelerator reads keeps pinned ids and slots, also through a lookup of CPU ids: from pageable
        # memory the slots would be copied when queued, before the host function wrote them
        accelerated = device.type == "cuda" or next(iter(self.buffers.values())).is_pinned()
        if accelerated:
            if self._captured or torch.cuda.is_current_stream_capturing():
                raise ValueError(f"PLE rows from files: a lookup of {n} row ids needs a staging area ({self.staging} rows) "
                                 f"and pinned ids ({io_rows}) that large, but CUDA graphs hold their addresses: the file "
                                 "tier sizes both for the most ids a step looks up at start-up (`staging_rows`).")  # fmt: skip
            torch.cuda.synchronize()  # in-flight host functions and kernels use the old buffers
        if n > self.staging:
            self._set_buffers(self._resize(self.slots + max(n, 2 * self.staging), self.slots))
        if n > io_rows:
            from qwen4_exp_hcu.ple.tiers.host_memory import pinned_empty

            size = max(n, self.staging)
            empty = pinned_empty if accelerated else lambda shape, dtype: torch.empty(shape, dtype=dtype)
            self._io_tensors = {k: empty((size,), dtype) for k, dtype in IO_DTYPES.items()}
            self._io = io = {k: t.numpy() for k, t in self._io_tensors.items()}
            self._keys = np.empty(miss_table_entries(size), dtype=np.int64)
            self._vals = np.empty_like(self._keys)
            state = self._state
            state.ids, state.cached, state.slot = io["ids"].ctypes.data, io["cached"].ctypes.data, io["slot"].ctypes.data
            state.keys, state.vals, state.table_size = self._keys.ctypes.data, self._vals.ctypes.data, self._keys.size

    def stage(self, ids: torch.Tensor, cached: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] global row ids -> ids into the buffers (resident slot or staging row; -1 where not owned),
        with the missing rows read from the files into staging. `cached` ([T, H] bool): pairs a GPU hot-row
        cache serves; they are neither counted nor read, and get buffer row 0 (owned, never read for a hit).
        On an accelerator the host part is queued in the current stream (`ple.host_call`), not waited for."""
        n = ids.numel()
        self._reserve(n, ids.device)
        io, flagged = self._io_tensors, cached is not None
        if ids.device.type != "cuda":  # through numpy: the buffers may be inference tensors, allocated in a forward
            self._io["ids"][:n] = ids.reshape(-1).numpy()
            if flagged:
                self._io["cached"][:n] = cached.reshape(-1).numpy()
            stager.library().qwen4_ple_stage(ctypes.byref(self._state), n, flagged)
            return torch.from_numpy(self._io["slot"][:n].copy()).view(ids.shape)
        stream, capturing = torch.cuda.current_stream(ids.device), torch.cuda.is_current_stream_capturing()
        self._captured |= capturing
        if self._done is not None and not capturing:
            stream.wait_event(self._done)  # the last eager lookup's kernel, perhaps on another stream, read staging
            # (a graph's lookups record nothing: the caller orders work after a replay, as `ple.prefetch` does)
        io["ids"][:n].copy_(ids.reshape(-1), non_blocking=True)
        if flagged:
            io["cached"][:n].copy_(cached.reshape(-1), non_blocking=True)
        launch(stream, self._host_function, self._call(n, flagged), "PLE rows from files: staging a lookup's rows")
        return io["slot"][:n].to(ids.device, non_blocking=True).view(ids.shape)

    def _call(self, n: int, flagged: bool) -> int:
        """The host node's argument for a lookup of `n` ids, one per size, kept for good: graphs replay it."""
        if (n, flagged) not in self._calls:
            call = stager.Call(ctypes.pointer(self._state), n, flagged)
            _CALLS.append(call)
            self._calls[n, flagged] = ctypes.addressof(call)
        return self._calls[n, flagged]

    def fill(self, ids: torch.Tensor) -> float:
        """Make the rows most frequent in a calibration id stream resident; the share of its owned lookups they serve."""
        local = ids.reshape(-1).to("cpu", torch.int64).numpy() - self.start
        self._wait()
        return self.promote(*np.unique(local[(local >= 0) & (local < self.n)], return_counts=True))

    def _promote_from_traffic(self) -> None:
        """Called by the C host function every `refresh_every` lookups (or once `FRESH_ROWS` rows were first read
        since the last): the most counted rows become resident, then counts halve. The work follows the rows read,
        not the table: over every row's count, a promotion at the release's 80 M rows per TP4 rank takes 2.9 s (a
        partition of all counts) on a 2-core host, every 256 lookups."""
        state = self._state
        counted = np.concatenate([self._carried, self._fresh[: state.fresh_len]])
        state.fresh_len = 0
        self.promote(counted, self.counts[counted], self.tier.promote_rows)
        self.counts[counted] >>= 1
        self._carried = counted[self.counts[counted] > 0]

    def promote(self, rows: np.ndarray, counts: np.ndarray, limit: int | None = None) -> float:
        """Of `rows` (distinct owned rows) with their `counts`, the `slots` most counted become resident, at most
        `limit` newcomers at a time (the most counted first; the rest come with later promotions). Rows that are
        resident stay; a newcomer takes an empty slot or one whose row is not among the most counted, in clock
        order (`_victims`); with a slot for every row, all stay. Returns the share of the counts the resident rows
        serve."""
        if self.slots == self.n:
            return 1.0
        k = min(self.slots, int(np.count_nonzero(counts)))
        best = np.argpartition(-counts, k - 1)[:k] if k else np.empty(0, dtype=np.int64)
        top = rows[best]
        held = self.slot_of[top]
        newcomers = top[held < 0]
        if limit is not None and newcomers.size > limit:
            newcomers = newcomers[np.argpartition(-counts[best][held < 0], limit - 1)[:limit]]
        newcomers = np.sort(newcomers)
        free = self._victims(held[held >= 0], newcomers.size)
        evicted = self.slot_row[free]
        self.slot_of[evicted[evicted >= 0]] = -1
        self._read_into_slots(newcomers, free)
        self.slot_of[newcomers] = free
        self.slot_row[free] = newcomers
        self.refreshes += 1
        self.share = float(counts[self.slot_of[rows] >= 0].sum() / max(int(counts.sum()), 1))
        return self.share

    def _victims(self, keep: np.ndarray, m: int) -> np.ndarray:
        """`m` slots not in `keep`, scanning on from where the last promotion stopped (a clock: the rows
        resident longest go first), a chunk at a time, so a promotion touches the slots it takes, not all."""
        kept = np.zeros(self.slots, dtype=bool)
        kept[keep] = True
        found, pos = [], self._clock
        while m > 0:
            end = min(pos + (1 << 20), self.slots)
            take = pos + np.flatnonzero(~kept[pos:end])[:m]
            found.append(take)
            m -= take.size
            pos = end % self.slots if m else (int(take[-1]) + 1) % self.slots
        self._clock = pos
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def _read_into_slots(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Rows (sorted) into resident `slots` (any order): read into staging a staging-full at a time, then placed.
        Staging does not grow for promotions: a fill of every slot would otherwise double the host bytes."""
        for a in range(0, rows.size, self.staging):
            b = min(a + self.staging, rows.size)
            self._read(rows[a:b], self.slots)
            for t in self._bytes.values():
                t[slots[a:b]] = t[self.slots : self.slots + b - a]

    def mapped(self, part: str) -> MappedRows:
        return MappedRows(self, part)

    def describe(self) -> str:
        where = f"{int((self.slot_row >= 0).sum())}/{self.slots} rows resident ({self.refreshes} promotions, last served {self.share:.0%}), the rest read from {self.tier.files.directory}"
        return where if not self._state.calls else f"{where}; {self.host_stats().describe()}"

    def host_stats(self) -> HostCallStats:
        s = self._state
        return HostCallStats(s.calls, s.ns / 1e9, s.longest_ns / 1e9)


class MappedRows:
    """One per-row part (`weight`, `weight_scale`) of a table's owned rows as they lie in the files: indexing
    with row ids (`rows[ids]`, a host tensor) reads those rows. What a GPU hot-row cache in front of the file
    tier copies its newcomers from (`ple.hot_rows.HotRows` takes it where it takes a host table)."""

    def __init__(self, rows: FileRows, part: str) -> None:
        self._rows, self._part = rows, part
        buffer = rows.buffers[part]
        self.shape, self.dtype, self.device = (rows.n, *buffer.shape[1:]), buffer.dtype, torch.device("cpu")

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows in `ids`' order, read in file order: the reader copies one run of rows per shard, so ids in
        count order (a hot-row refresh's) would cost a copy each (182 k rows: 386 ms, sorted 62 ms on a 2-core
        host, `bench_file_promotions`)."""
        ids = ids.reshape(-1).numpy()
        order = np.argsort(ids, kind="stable")
        read = torch.empty((ids.size, *self.shape[1:]), dtype=self.dtype)
        self._rows._read(ids[order], 0, {self._part: byte_rows(read)})
        out = torch.empty_like(read)
        out[torch.from_numpy(order)] = read
        return out


_CALLS: list[stager.Call] = []  # never freed: a captured graph may replay one after its rows have gone


def _retire(state: stager.Stager) -> None:
    state.alive = 0  # its buffers are about to be freed: a graph replaying its host node later does nothing


def byte_rows(t: torch.Tensor) -> np.ndarray:
    """A host tensor's rows as a [rows, bytes per row] uint8 array over its memory (rows move as bytes; 0 rows too)."""
    return t.view(torch.uint8).view(len(t), math.prod(t.shape[1:]) * t.element_size()).numpy()


def miss_table_entries(ids: int) -> int:
    """Entries of the table `stage.c` finds a lookup's distinct misses in: a power of two, >= 2 x the ids."""
    return 2 << max(4, (ids - 1).bit_length())


def index_bytes(rows: int, slots: int, staging_rows: int, traffic: bool) -> int:
    """Pageable host bytes a table's file tier keeps beside its rows: the slot maps (row -> slot, slot -> row), the
    miss table (keys and values), and when following traffic the counts and the promotion's candidates."""
    maps = 4 * rows + 4 * slots + 16 * miss_table_entries(staging_rows)
    return maps + (4 * rows + 8 * min(rows, FRESH_ROWS) if traffic else 0)


def resident_slots(resident_bytes: int, rows: int, row_bytes: int) -> int:
    """Rows a table keeps resident in `resident_bytes` (at most all of them)."""
    return max(0, min(rows, resident_bytes // row_bytes))

