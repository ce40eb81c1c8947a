"""The file tier's per-lookup host work: the table's per-row buffers (the resident rows, then the staging area) and
the C host function that fills them (`stage.c` through `stager`), queued in the stream's order on an accelerator
(`host_call`) or run at once on the CPU.

A lookup's ids go to pinned memory, the host function counts them, stages the rows that are not resident from the
mapped files and writes each pair's buffer row to pinned memory, and the buffer rows go back, all queued without
a host sync. CUDA graphs capture it as a host node, so it runs in full decode graphs too. A captured node holds the
addresses of this area's buffers, pinned ids and its call's argument: they live as long as this object, and a
graph that captured a lookup must not outlive the table it looks up (its kernel reads the same buffers).
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch

from qwen4_exp_hcu.ple.tiers import stager
from qwen4_exp_hcu.ple.tiers.file_map import byte_rows
from qwen4_exp_hcu.ple.tiers.host_call import HostCallStats, launch, launcher
from qwen4_exp_hcu.ple.tiers.host_memory import pinned_empty

# pinned per id of a lookup, shared with its host function: the id, the hot-row cache's flag, the buffer row
IO_DTYPES = {"ids": torch.int64, "cached": torch.bool, "slot": torch.int64}


class StagingArea:
    """Buffers of `slots` resident rows and `capacity` staging rows per part, from `resize(rows, keep)` (the
    table's: it allocates them, keeping the first `keep` rows), and the host function's `state`: this object sets
    the buffers' and the lookup's fields, its owner (`FileRows`) those of the table and its residency."""

    def __init__(self, resize, slots: int, capacity: int) -> None:
        self.slots, self._resize = slots, resize
        self._host_function = stager.host_function()  # built now: no C compiler fails at load
        self.state = stager.Stager(slots=slots, alive=1)
        self._calls: dict[tuple[int, bool], stager.Call] = {}  # (ids, flagged) -> the host node's argument
        weakref.finalize(self, _retire, self.state)
        self._set_buffers(resize(slots + capacity))
        self._io: dict[str, np.ndarray] = {}  # ids / cached / slots of a lookup (pinned on an accelerator), read by C
        self._io_tensors: dict[str, torch.Tensor] = {}
        self.captured = False  # a CUDA graph holds the buffers' addresses: they can no longer be reallocated
        self._done: torch.cuda.Event | None = None

    def _set_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """The per-row buffers, and their bytes as numpy arrays: what the host function writes (no torch there)."""
        self.buffers = buffers
        self.bytes = {part: byte_rows(t) for part, t in buffers.items()}
        self._dst = np.array([b.ctypes.data for b in self.bytes.values()], dtype=np.uintp)
        self._row_bytes = np.array([b.shape[1] for b in self.bytes.values()], dtype=np.int64)
        self.state.dst, self.state.row_bytes = self._dst.ctypes.data, self._row_bytes.ctypes.data

    @property
    def capacity(self) -> int:
        """Rows a lookup stages before the area grows."""
        return len(next(iter(self.buffers.values()))) - self.slots

    @property
    def row_bytes(self) -> dict[str, int]:
        return {part: b.shape[1] for part, b in self.bytes.items()}

    @property
    def pinned(self) -> bool:
        """Read by an accelerator (over UVA)."""
        return next(iter(self.buffers.values())).is_pinned()

    def ready(self) -> None:
        """After loading: a table an accelerator reads gets its launcher and pinned ids now, not mid-capture."""
        if self.pinned:
            launcher()
            self.reserve(self.capacity, torch.device("cuda"))

    def wait(self) -> None:
        """Before the main thread rewrites the buffers: the last lookup (its host function and kernel) is done."""
        if self._done is not None:
            self._done.synchronize()

    def lookup_done(self, device: torch.device) -> None:
        """After a lookup's kernel: the next lookup's host function waits for it (on the GPU, not the host)."""
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()

    def reserve(self, n: int, device: torch.device) -> None:
        """Staging and a lookup's ids and slots (pinned on an accelerator) for `n` row ids. Serving sizes them at
        start-up for its largest step; growing re-pins host memory, which no CUDA graph may capture."""
        io_rows = len(self._io["ids"]) if self._io else 0
        if n <= self.capacity and n <= io_rows:
            return
        # a table an accelerator reads keeps pinned ids and slots, also through a lookup of CPU ids: from pageable
        # memory the slots would be copied when queued, before the host function wrote them
        accelerated = device.type == "cuda" or self.pinned
        if accelerated:
            if self.captured or torch.cuda.is_current_stream_capturing():
                raise ValueError(f"PLE rows from files: a lookup of {n} row ids needs a staging area ({self.capacity} rows) "
                                 f"and pinned ids ({io_rows}) that large, but CUDA graphs hold their addresses: the file "
                                 "tier sizes both for the most ids a step looks up at start-up (`staging_rows`).")  # fmt: skip
            torch.cuda.synchronize()  # in-flight host functions and kernels use the old buffers
        if n > self.capacity:
            self._set_buffers(self._resize(self.slots + max(n, 2 * self.capacity), self.slots))
        if n > io_rows:
            self._set_io(max(n, self.capacity), accelerated)

    def _set_io(self, size: int, pinned: bool) -> None:
        """A lookup's ids, flags and slots for `size` ids, and the table the host function finds its distinct
        misses in."""
        empty = pinned_empty if pinned else lambda shape, dtype: torch.empty(shape, dtype=dtype)
        self._io_tensors = {k: empty((size,), dtype) for k, dtype in IO_DTYPES.items()}
        self._io = io = {k: t.numpy() for k, t in self._io_tensors.items()}
        self._keys = np.empty(miss_table_entries(size), dtype=np.int64)
        self._vals = np.empty_like(self._keys)
        state = self.state
        state.ids, state.cached, state.slot = io["ids"].ctypes.data, io["cached"].ctypes.data, io["slot"].ctypes.data
        state.keys, state.vals, state.table_size = self._keys.ctypes.data, self._vals.ctypes.data, self._keys.size

    def stage(self, ids: torch.Tensor, cached: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] global row ids -> ids into the buffers, through the host function (`FileRows.stage` says what they
        are). On an accelerator it is queued in the current stream (`host_call`), not waited for."""
        n = ids.numel()
        self.reserve(n, ids.device)
        io, flagged = self._io_tensors, cached is not None
        if ids.device.type != "cuda":  # through numpy: the buffers may be inference tensors, allocated in a forward
            self._io["ids"][:n] = ids.reshape(-1).numpy()
            if flagged:
                self._io["cached"][:n] = cached.reshape(-1).numpy()
            stager.library().qwen4_ple_stage(ctypes.byref(self.state), n, flagged)
            return torch.from_numpy(self._io["slot"][:n].copy()).view(ids.shape)
        stream, capturing = torch.cuda.current_stream(ids.device), torch.cuda.is_current_stream_capturing()
        self.captured |= capturing
        if self._done is not None and not capturing:
            stream.wait_event(self._done)  # the last eager lookup's kernel, perhaps on another stream, read staging
            # (a graph's lookups record nothing: the caller orders work after a replay, as `ple.prefetch` does)
        io["ids"][:n].copy_(ids.reshape(-1), non_blocking=True)
        if flagged:
            io["cached"][:n].copy_(cached.reshape(-1), non_blocking=True)
        launch(stream, self._host_function, self._call(n, flagged), "PLE rows from files: staging a lookup's rows")
        return io["slot"][:n].to(ids.device, non_blocking=True).view(ids.shape)

    def _call(self, n: int, flagged: bool) -> int:
        """The address of the host node's argument for a lookup of `n` ids, one per size: graphs replay it."""
        if (n, flagged) not in self._calls:
            self._calls[n, flagged] = stager.Call(ctypes.pointer(self.state), n, flagged)
        return ctypes.addressof(self._calls[n, flagged])

    @property
    def pages_asked(self) -> int:
        """File pages the host function asked the kernel for before copying its misses (`FileTier.ask_pages_first`)."""
        return self.state.pages_asked

    def host_stats(self) -> HostCallStats:
        s = self.state
        return HostCallStats(s.calls, s.ns / 1e9, s.longest_ns / 1e9)


def _retire(state: stager.Stager) -> None:
    state.alive = 0  # its buffers are about to be freed: the host function does nothing more with them


def miss_table_entries(ids: int) -> int:
    """Entries of the table `stage.c` finds a lookup's distinct misses in: a power of two, >= 2 x the ids."""
    return 2 << max(4, (ids - 1).bit_length())
