"""Which of a table's rows stay resident in a faster tier: the one policy of the GPU hot-row cache (`hot_rows`,
accelerator slots in front of host memory) and of the file tier (`file_rows`, host slots in front of the files).

Rows are counted, from a calibration id stream (`calibration_counts`) or from served traffic (each tier counts
its lookups its own way and halves the counts after each promotion, so residency follows the traffic). A
promotion makes the most counted rows resident, at most `limit` newcomers at a time, the most counted first: a
promotion runs inside a lookup and stalls it, and after a long prefill every row it read is counted. Resident
rows among the most counted keep their slots; a newcomer takes a slot whose row is not among them, in clock
order (the rows resident longest go first, empty slots before any), so a promotion touches the slots it takes,
not all of them.
"""

from __future__ import annotations

import torch

REFRESH_EVERY = 256  # lookups between promotions from traffic
_CLOCK_CHUNK = 1 << 20  # slots the clock scans at a time


def calibration_counts(ids: torch.Tensor, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct owned rows, times each was read) of a calibration stream of row ids, on the host: rows of
    `[start, start + n)`, as offsets from `start`."""
    local = ids.reshape(-1).to("cpu", torch.int64) - start
    return torch.unique(local[(local >= 0) & (local < n)], return_counts=True)


class ResidentRows:
    """The residency of `n` owned rows in `slots` slots: `slot_of` [n] (owned row -> slot, -1: not resident) and
    `slot_row` [slots] (slot -> owned row, -1: empty), on any device; the tier reads them (and `stage.c` may
    share their memory). A promotion updates both and returns what its tier copies into which slots."""

    def __init__(self, slot_of: torch.Tensor, slot_row: torch.Tensor) -> None:
        self.slot_of, self.slot_row = slot_of, slot_row
        self.clock = 0  # the slot the next victim scan starts at
        self.refreshes, self.share = 0, 0.0  # promotions so far; share of the counts the last one serves

    @torch.no_grad()
    def promote(self, counts: torch.Tensor, rows: torch.Tensor | None = None, limit: int | None = None):
        """Of the counted rows (row `rows[i]` read `counts[i]` times; row `i` when `rows` is None), the `slots`
        most counted become resident, at most `limit` newcomers. Returns (newcomers in row order, their slots),
        the maps already updated: the tier copies those rows into those slots before its next lookup reads them."""
        k = min(self.slot_row.numel(), int(torch.count_nonzero(counts)))
        best = torch.topk(counts, k, sorted=False).indices if k < counts.numel() else torch.arange(k, device=counts.device)
        top = best if rows is None else rows[best]
        held = self.slot_of[top]
        fresh = held < 0
        newcomers = top[fresh]
        if limit is not None and newcomers.numel() > limit:
            newcomers = newcomers[torch.topk(counts[best][fresh], limit, sorted=False).indices]
        newcomers = newcomers.sort().values
        free = self._victims(held[~fresh], newcomers.numel())
        evicted = self.slot_row[free]
        self.slot_of[evicted[evicted >= 0]] = -1
        self.slot_of[newcomers] = free.to(self.slot_of.dtype)
        self.slot_row[free] = newcomers.to(self.slot_row.dtype)
        self.refreshes += 1
        resident = (self.slot_of if rows is None else self.slot_of[rows]) >= 0
        self.share = float(counts[resident].sum() / counts.sum().clamp_min(1))
        return newcomers, free

    def _victims(self, keep: torch.Tensor, m: int) -> torch.Tensor:
        """`m` slots not in `keep`, scanning on from where the last promotion stopped, a chunk at a time."""
        slots = self.slot_row.numel()
        kept = torch.zeros(slots, dtype=torch.bool, device=self.slot_row.device)
        kept[keep.long()] = True
        found, pos = [], self.clock
        while m > 0:
            end = min(pos + _CLOCK_CHUNK, slots)
            take = pos + torch.nonzero(~kept[pos:end]).flatten()[:m]
            found.append(take)
            m -= take.numel()
            pos = end % slots if m else (int(take[-1]) + 1) % slots
        self.clock = pos
        return torch.cat(found) if found else torch.empty(0, dtype=torch.int64, device=kept.device)


class ResidentTier:
    """A tier whose residency is a `ResidentRows` (`self.resident`): its slots in use, its promotion count and what
    it serves."""

    resident: ResidentRows

    @property
    def refreshes(self) -> int:
        return self.resident.refreshes

    @property
    def filled(self) -> int:
        """Slots holding a row: below the slots while the calibration or the traffic so far named fewer rows."""
        return int((self.resident.slot_row >= 0).sum())

    @property
    def share(self) -> float:
        """The share of the counts the rows made resident by the last promotion serve."""
        return self.resident.share
