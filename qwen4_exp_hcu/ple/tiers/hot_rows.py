"""A GPU cache of a host-resident PLE table's most used rows: the lookup kernel serves a hit from
accelerator memory and reads host memory only on a miss (n-gram ids of natural text repeat: a cache of a
few percent of the rows serves about half the lookups, see docs/PERFORMANCE.md).

Which rows it holds follows `resident_rows`, filled once from a calibration id stream (`fill`) or kept up to date
from served traffic (`observe`): every lookup adds its owned rows to counts kept on the accelerator (capturable),
and every `refresh_every` eager lookups a promotion brings in the most counted rows, at most `refresh_rows`
newcomers, and the counts halve. Refreshes run only outside CUDA-graph capture, on the lookup's stream, and only
newcomers cross from host memory. Every buffer is allocated once, so captured graphs keep valid addresses.
"""

from __future__ import annotations

import torch

from qwen4_exp_hcu.ple.tiers.resident_rows import REFRESH_EVERY, ResidentRows, ResidentTier, calibration_counts

REFRESH_ROWS = 65536  # newcomers one refresh from traffic copies at most (10.6 MB of release rows)


class HotRows(ResidentTier):
    """Cache slots for `weight`, a table's rows from `start` on (+ `scale`, [rows, 1], INT8 tables), on `device`.
    `weight` and `scale` are host tensors, or views of rows in the checkpoint's files (`file_map.MappedRows`)."""

    def __init__(self, weight, scale, start: int, slots: int, device, observe: bool) -> None:
        if slots < 1:
            raise ValueError(f"a hot-row cache needs at least one slot, got {slots}.")
        self.weight, self.scale, self.start, self.n = weight, scale, start, weight.shape[0]
        self.map = torch.full((self.n,), -1, dtype=torch.int32, device=device)  # owned row -> slot, -1: miss
        self.rows = torch.zeros((slots, weight.shape[1]), dtype=weight.dtype, device=device)
        self.row_scales = None if scale is None else torch.zeros((slots, 1), dtype=scale.dtype, device=device)
        self.slot_row = torch.full((slots,), -1, dtype=torch.int64, device=device)  # slot -> owned row
        # traffic counts per owned row; the last entry absorbs rows another rank owns
        self.counts = torch.zeros(self.n + 1, dtype=torch.int32, device=device) if observe else None
        self.refresh_every, self.refresh_rows = REFRESH_EVERY, REFRESH_ROWS
        self._eager_lookups = 0
        self.resident = ResidentRows(self.map, self.slot_row)

    @staticmethod
    def bytes_needed(rows: int, slots: int, row_bytes: int, observe: bool) -> int:
        """Accelerator bytes of a cache over `rows` owned rows with `slots` slots of `row_bytes` each."""
        return 4 * rows + (4 * (rows + 1) if observe else 0) + slots * (row_bytes + 8)

    @classmethod
    def slots_for(cls, budget: int, rows: int, row_bytes: int, observe: bool) -> int:
        """The most slots `budget` bytes hold (at most one per row); < 1 when the row map alone is too big."""
        return min(rows, (budget - cls.bytes_needed(rows, 0, row_bytes, observe)) // (row_bytes + 8))

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(row -> slot map, cached rows, their scales): what the lookup kernel reads."""
        return self.map, self.rows, self.row_scales

    def describe(self) -> str:
        source = "served traffic" if self.counts is not None else "calibration"
        return (f"{self.filled}/{self.rows.shape[0]} hot rows from {source} "
                f"({self.nbytes / 2**20:.1f} MiB, {self.refreshes} refreshes, last served {self.share:.0%})")

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.map, self.rows, self.row_scales, self.slot_row, self.counts) if t is not None)

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """[T, H] row ids -> [T*H] int32 cache slot per pair, -1 where the cache does not serve it: the kernel's
        cache map when the ids it gathers are not table rows (the file tier's staged ids)."""
        local = ids.reshape(-1) - self.start
        owned = (local >= 0) & (local < self.n)
        return torch.where(owned, self.map[torch.where(owned, local, 0)], -1)  # no boolean indexing: graphs capture it

    def observe(self, ids: torch.Tensor) -> None:
        """Count a lookup's owned rows; refresh when due and not capturing (call before the lookup)."""
        if self.counts is None:
            return
        local = ids.reshape(-1) - self.start
        local = torch.where((local >= 0) & (local < self.n), local, self.n)
        self.counts.index_add_(0, local, torch.ones_like(local, dtype=torch.int32))
        if ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        self._eager_lookups += 1
        if self._eager_lookups >= self.refresh_every:
            self._eager_lookups = 0
            self.refresh(self.counts[:-1], self.refresh_rows)
            self.counts.bitwise_right_shift_(1)

    def fill(self, ids: torch.Tensor) -> float:
        """Cache the most frequent owned rows of a calibration id stream; returns the share of its owned
        lookups they serve."""
        rows, counts = calibration_counts(ids, self.start, self.n)
        return self._promote(counts, rows)

    def refresh(self, counts: torch.Tensor, limit: int | None = None) -> float:
        """Bring the most counted rows (`counts` per owned row) into the cache, at most `limit` newcomers
        (`resident_rows`). Returns the share of the counts the cache then serves."""
        return self._promote(counts, None, limit)

    @torch.no_grad()
    def _promote(self, counts: torch.Tensor, rows: torch.Tensor | None, limit: int | None = None) -> float:
        dev = self.map.device
        newcomers, free = self.resident.promote(counts.to(dev), None if rows is None else rows.to(dev), limit)
        self.rows[free] = self.weight[newcomers.to(self.weight.device)].to(dev)
        if self.scale is not None:
            self.row_scales[free] = self.scale[newcomers.to(self.scale.device)].to(dev)
        return self.share


def load_calibration_tokens(path: str, vocab_size: int) -> torch.Tensor:
    """The `tokens` tensor of a safetensors file: one 1-D stream of token ids (EOS between documents)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        if "tokens" not in f.keys():
            raise ValueError(f"hot_rows_calibration {path}: no `tokens` tensor (it holds {sorted(f.keys())}).")
        tokens = f.get_tensor("tokens")
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool or not tokens.numel():
        raise ValueError(f"hot_rows_calibration {path}: `tokens` must be a non-empty 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}.")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"hot_rows_calibration {path}: token ids must lie in [0, {vocab_size}).")
    return tokens.long()
