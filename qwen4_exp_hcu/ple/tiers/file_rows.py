"""PLE rows beyond host RAM: a table whose rows stay in the checkpoint's safetensors files (memory-mapped, never
read whole, `file_map`), with the most-read rows resident in host memory (pinned on an accelerator).

The read path is a host gather (`staging`): each lookup brings its ids to the host, copies the rows that are not
resident from the mapped files into a staging area, and hands the lookup kernel remapped ids over one buffer that
holds the resident rows followed by the staging area. The bytes are the checkpoint's, so lookups are exact.
Accelerators that read pageable host memory directly could skip the staging copy, but the H200 reports
`cudaDevAttrPageableMemoryAccess` = 0 (docs/PERFORMANCE.md), so every platform takes the host gather.

Resident rows follow `resident_rows`, as the GPU hot-row cache does: from calibration ids (`fill`), or from the
traffic, which the host function counts (every `refresh_every` lookups it calls back for a promotion of at most
`promote_rows` newcomers, and counts halve). A GPU hot-row cache can sit in front (`PLETable.enable_hot_rows`):
the rows it serves are neither staged nor counted here, so host memory keeps the next most read rows, and it
copies its newcomers from the files (`MappedRows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles, MappedRows, MappedShards
from qwen4_exp_hcu.ple.tiers.host_call import guarded
from qwen4_exp_hcu.ple.tiers.resident_rows import REFRESH_EVERY, ResidentRows, ResidentTier, calibration_counts
from qwen4_exp_hcu.ple.tiers.stager import ASK_PAGES_FIRST
from qwen4_exp_hcu.ple.tiers.staging import StagingArea, miss_table_entries

PROMOTE_ROWS = 4096  # newcomers a traffic promotion reads from the files at most (the most read first)
FRESH_ROWS = 1 << 20  # rows first read since the last promotion that bring the next one forward (8 MB of candidates)
# the storage settings the file tier does not combine with: its resident rows are private 4 KiB host pages, beside
# their scales, that its host function writes
EXCLUDES = {"shared": "a host copy shared by DP replicas", "huge_pages": "2 MiB host pages",
            "scales_on_device": "scales on the accelerator"}  # fmt: skip


@dataclass(frozen=True)
class FileTier:
    """The opt-in file tier of `PLEStorage`: the checkpoint's files and the host bytes per table for resident
    rows (`host_table_gib` over the PLE layers)."""

    files: CheckpointFiles
    resident_bytes: int
    refresh_every: int = REFRESH_EVERY  # 0: resident rows only from calibration (`fill`)
    promote_rows: int | None = PROMOTE_ROWS  # a promotion runs inside a lookup: its file reads (a page fault per row) stall it; None: no cap
    staging_rows: int = 4096  # rows a lookup reads from the files before the staging area grows (serving sizes it for its largest step)
    # when a lookup asks the kernel for its missing rows' pages (`MADV_WILLNEED`) before copying them, so that reads
    # of pages the page cache lacks are queued together, not faulted in one at a time: "after_a_fault" (once its
    # copies read the drive), "always" (the misses sorted and a syscall a run of pages, also for cached pages) or
    # "never" (`stage.c`)
    ask_pages_first: str = "after_a_fault"

    def __post_init__(self) -> None:
        if self.ask_pages_first not in ASK_PAGES_FIRST:
            raise ValueError(f"FileTier.ask_pages_first is one of {', '.join(ASK_PAGES_FIRST)}, not {self.ask_pages_first!r}.")


def excluded_settings(storage) -> list[str]:
    """What in `storage` (a `PLEStorage`, which holds the tier) the file tier does not combine with, in words."""
    return [why for name, why in EXCLUDES.items() if getattr(storage, name) not in (None, False)]


class FileRows(ResidentTier):
    """Owned rows `[start, start + n)` of a table of `row_bytes` per row. The table's per-row buffers
    (`resize(rows, keep)` allocates them, keeping the first `keep` rows) hold the resident rows the budget
    allows (`slots`), then the staging area (`staging`)."""

    def __init__(self, tier: FileTier, start: int, n: int, shard_rows: int, row_bytes: int, resize) -> None:
        self.tier, self.start, self.n = tier, start, n
        self.slots = slots = resident_slots(tier.resident_bytes, n, row_bytes)
        self.slot_of = np.full(n, -1, dtype=np.int32)  # owned row -> resident slot, -1: in the files
        self.slot_row = np.full(slots, -1, dtype=np.int32)  # resident slot -> owned row (a rank owns < 2**31 rows)
        self.resident = ResidentRows(torch.from_numpy(self.slot_of), torch.from_numpy(self.slot_row))
        self.staging = StagingArea(resize, slots, tier.staging_rows)
        self.shards = MappedShards(tier.files, start, n, shard_rows, self.staging.row_bytes)
        state = self.staging.state  # the host function's view of the table (`stage.c`)
        state.start, state.n, state.shard_rows, state.slot_of = start, n, shard_rows, self.slot_of.ctypes.data
        state.first_shard, state.n_parts, state.src = self.shards.first, self.shards.src.shape[1], self.shards.src.ctypes.data
        state.ask_first = ASK_PAGES_FIRST.index(tier.ask_pages_first)
        state.in_memory = self.shards.memory_mask
        self.counts = np.zeros(n, dtype=np.int32) if tier.refresh_every else None
        if self.counts is not None:
            # the host function counts each lookup's rows, and every `refresh_every` lookups calls
            # `_promote_from_traffic` over the rows counted from zero since (`_fresh`) and those whose count survived
            # the last halving (`_carried`): promotions never scan the table
            self._fresh = np.empty(min(n, FRESH_ROWS), dtype=np.int64)
            self._carried = np.empty(0, dtype=np.int64)
            state.counts, state.fresh, state.fresh_cap = self.counts.ctypes.data, self._fresh.ctypes.data, self._fresh.size
            state.refresh_every = tier.refresh_every
            state.promote = guarded(self._promote_from_traffic, "PLE rows from files: promoting the most read rows")

    def add_shard(self, j: int, parts: dict[str, str]) -> None:
        """Map checkpoint shard `j`'s per-row tensors (`part -> tensor name`); shapes must fit the table."""
        self.shards.add(j, parts)

    def loaded(self) -> None:
        """After the shards are mapped (each one that holds owned rows, else an error naming it): a budget that holds
        every owned row makes them all resident now."""
        self.shards.check_complete()
        if self.slots == self.n:
            every = np.arange(self.n)
            self.shards.read(every, self.staging.bytes)
            self.slot_of[:], self.slot_row[:] = every, every
        self.staging.ready()

    def stage(self, ids: torch.Tensor, cached: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] global row ids -> ids into the buffers (resident slot or staging row; -1 where not owned),
        with the missing rows read from the files into staging. `cached` ([T, H] bool): pairs a GPU hot-row
        cache serves; they are neither counted nor read, and get buffer row 0 (owned, never read for a hit).
        On an accelerator the host part is queued in the current stream (`host_call`), not waited for."""
        return self.staging.stage(ids, cached)

    def lookup_done(self, device: torch.device) -> None:
        self.staging.lookup_done(device)

    def fill(self, ids: torch.Tensor) -> float:
        """Make the rows most frequent in a calibration id stream resident; the share of its owned lookups they serve."""
        rows, counts = calibration_counts(ids, self.start, self.n)
        self.staging.wait()
        return self.promote(rows.numpy(), counts.numpy())

    def _promote_from_traffic(self) -> None:
        """Called by the C host function every `refresh_every` lookups (or once `FRESH_ROWS` rows were first read
        since the last): a promotion over the rows counted, then counts halve. The work follows the rows read,
        not the table: over every row's count, a promotion at the release's 80 M rows per TP4 rank takes 2.9 s (a
        partition of all counts) on a 2-core host, every 256 lookups."""
        state = self.staging.state
        counted = np.concatenate([self._carried, self._fresh[: state.fresh_len]])
        state.fresh_len = 0
        self.promote(counted, self.counts[counted], self.tier.promote_rows)
        self.counts[counted] >>= 1
        self._carried = counted[self.counts[counted] > 0]

    def promote(self, rows: np.ndarray, counts: np.ndarray, limit: int | None = None) -> float:
        """Of `rows` (distinct owned rows) with their `counts`, the most counted become resident (`resident_rows`),
        their rows read from the files; with a slot for every row, all are resident already. Returns the share of
        the counts the resident rows serve."""
        if self.slots == self.n:
            return 1.0
        newcomers, free = self.resident.promote(torch.from_numpy(counts), torch.from_numpy(rows), limit)
        self._read_into_slots(newcomers.numpy(), free.numpy())
        return self.share

    def _read_into_slots(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Rows (sorted) into resident `slots` (any order): read into staging a staging-full at a time, then placed.
        Staging does not grow for promotions: a fill of every slot would otherwise double the host bytes."""
        step, buffers = self.staging.capacity, self.staging.bytes
        for a in range(0, rows.size, step):
            b = min(a + step, rows.size)
            self.shards.read(rows[a:b], buffers, self.slots)
            for t in buffers.values():
                t[slots[a:b]] = t[self.slots : self.slots + b - a]

    def mapped(self, part: str) -> MappedRows:
        return MappedRows(self.shards, part, self.staging.buffers[part])

    def describe(self) -> str:
        where = (f"{self.filled}/{self.slots} rows resident ({self.refreshes} promotions, last "
                 f"served {self.share:.0%}), the rest read from {self.tier.files.directory}")  # fmt: skip
        if not self.tier.refresh_every and self.filled < self.slots:
            # calibrated rows stay put: slots the calibration did not name stay empty while serving
            where += (f"; {self.slots - self.filled} slots stay empty: the calibration holds fewer of this "
                      f"rank's rows than the budget pays for (a longer token stream fills them)")  # fmt: skip
        stats = self.staging.host_stats()
        if not stats.calls:
            return where
        asked = f", {self.staging.pages_asked} file pages asked for first" if self.tier.ask_pages_first != "never" else ""
        return f"{where}; {stats.describe()}{asked}"


def index_bytes(rows: int, slots: int, staging_rows: int, traffic: bool, in_memory_row_bytes: int = 2) -> int:
    """Pageable host bytes a table's file tier keeps beside its rows: every row's parts held in memory
    (`file_map.in_memory_parts`: an INT8 table's 2-byte scales), the slot maps (row -> slot, slot -> row), the miss
    table (keys and values), and when following traffic the counts and the promotion's candidates."""
    maps = (in_memory_row_bytes + 4) * rows + 4 * slots + 16 * miss_table_entries(staging_rows)
    return maps + (4 * rows + 8 * min(rows, FRESH_ROWS) if traffic else 0)


def resident_slots(resident_bytes: int, rows: int, row_bytes: int) -> int:
    """Rows a table keeps resident in `resident_bytes` (at most all of them)."""
    return max(0, min(rows, resident_bytes // row_bytes))
