"""`PLEStorage`: how one rank stores its PLE tables and which group shards their rows, described once (by
vLLM's placement, `model.ple_placement`, or by a notebook) and handed whole to `PLELayer`, `ETPLookup` and
`PLETable`, so that every option has one name at every floor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from qwen4_exp_hcu.ple.tiers.file_rows import FileTier
    from qwen4_exp_hcu.ple.tiers.host_memory import SharedHost


class Group(Protocol):
    """The collectives an ETP group offers: vLLM's `GroupCoordinator` as is, or `ple.etp.TorchGroup`."""

    world_size: int
    rank_in_group: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


def owned_rows(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous `[start, end)` row range of `rank`; sizes differ by at most one row."""
    base, extra = divmod(rows, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class PLEStorage:
    format: str | None = None
    """`ple.formats` name; None: as the checkpoint declares it (`load_ple_layer`), BF16 for a table filled directly."""
    device: torch.device | str = "cpu"  # where lookups run
    host: bool = False  # rows in host memory, pinned when an accelerator exists (read over UVA)
    huge_pages: bool = False  # private host rows on 2 MiB pages (`host_memory.huge_page_empty`)
    scales_on_device: bool = False  # per-row scales on the accelerator: one host read per row instead of two
    shared: SharedHost | None = None  # one host copy per node for the DP replicas (`host_memory.SharedHost`)
    etp_group: Group | None = None  # the ranks that split the rows (`ple.etp`); None: the whole table
    across_dp: bool = False  # the ETP group's ranks hold different tokens (rows over TP x DP)
    replica_group: Group | None = None  # across DP: the ranks of this rank's DP replica (they hold the same tokens)
    file_tier: FileTier | None = None  # rows beyond a host budget stay in the checkpoint's files (`ple.file_rows`)

    def owned_rows(self, rows: int) -> tuple[int, int]:
        """This rank's `[start, end)` of a table of `rows` rows."""
        g = self.etp_group
        return (0, rows) if g is None else owned_rows(rows, g.rank_in_group, g.world_size)

    def scoped(self, name: str) -> PLEStorage:
        """The same storage for one table: its shared host files get `name` (each table has its own)."""
        return self if self.shared is None else dataclasses.replace(self, shared=self.shared.scoped(name))
