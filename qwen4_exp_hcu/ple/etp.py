"""ETP lookup: a PLE table's rows split into contiguous ranges over an embedding-parallel group.

The group is the TP group (every rank holds the same tokens: each looks up its own rows, zeros for the
rest, and an all-reduce sums them) or, with ``embedding_across_dp``, TP x DP ranks where only the TP ranks
of one DP replica (its `replica` group) hold the same tokens. Then each TP rank takes a 1/TP slice of its
replica's tokens, so every token of the step appears exactly once: slices of ids are all-gathered over
the group (padded to the largest), every rank looks up its rows for all of them, a reduce-scatter hands
each rank the sum for its own slice, and an all-gather within the replica puts the replica's tokens back
together. Per rank that moves ((W-1)(ids + row) + (TP-1) row) / TP bytes per replica token, against
(W-1)(ids + row) when every TP rank sends every token (TP times the same ids) and 2(W-1)/W * DP rows + (DP-1)
ids for upstream vLLM's DP gather + all-reduce (`benchmarks/plan_memory.py`). Combining happens in bf16
after the fused dequant; since exactly one rank owns each row, the sum is exact.

Collectives go through a small group interface (`ple.storage.Group`) that vLLM's `GroupCoordinator` satisfies as is
(`world_size`, `rank_in_group`, `all_reduce`, `all_gather(x, dim)`, `reduce_scatter(x, dim)`) and that
`TorchGroup` adapts for plain `torch.distributed` process groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable


class TorchGroup:
    """`torch.distributed` process group with GroupCoordinator's collective signatures."""

    def __init__(self, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank_in_group = dist.get_rank(group)
        self._gloo = dist.get_backend(group) == "gloo"

    def all_reduce(self, x):
        dist.all_reduce(x, group=self.group)
        return x

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather(self, x, dim=-1):
        assert dim == 0, "TorchGroup gathers along dim 0"
        out = x.new_empty(self.world_size * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x, dim=-1):
        assert dim == 0, "TorchGroup scatters along dim 0"
        n = x.shape[0] // self.world_size
        if self._gloo:  # gloo has no reduce_scatter
            x = self.all_reduce(x.contiguous())
            return x[self.rank_in_group * n : (self.rank_in_group + 1) * n].clone()
        out = x.new_empty(n, *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous(), group=self.group)
        return out


def looked_up_tokens(world: int, across_dp: bool, tokens: int, replica: int = 1) -> int:
    """Tokens whose rows a rank looks up in a step of `tokens` (across DP the token bound): its own, or across DP
    every ETP rank's slice of its replica's tokens (`ETPLookup.__call__`'s all-gather)."""
    return world * -(-tokens // replica) if across_dp else tokens


def combine_bytes(world: int, across_dp: bool, num_heads: int, dim: int, tokens: int, replica: int = 1) -> int:
    """Bytes each rank sends/receives (ring volume) combining one step: `tokens` = this rank's tokens, or
    across DP the step's token bound (largest replica); `replica` = TP ranks per DP replica."""
    if world == 1:
        return 0
    row = num_heads * dim * 2
    if not across_dp:
        return 2 * (world - 1) * row * tokens // world
    s = -(-tokens // replica)  # each TP rank's slice
    return (world - 1) * s * (num_heads * 8 + row) + (replica - 1) * s * row


class ETPLookup:
    """A PLE table sharded by rows over `storage.etp_group`: builds this rank's `PLETable` (its owned range)
    and looks rows up, combining over the group; `storage.across_dp` when the ranks hold different tokens,
    with `storage.replica_group` the ranks of this rank's DP replica (its TP group; None: one rank per replica)."""

    def __init__(self, rows: int, dim: int, storage: PLEStorage = PLEStorage(), shard_rows: int | None = None):
        group, replica = storage.etp_group, storage.replica_group
        self.group = group if group is not None and group.world_size > 1 else None
        self.across_dp = storage.across_dp and self.group is not None
        self.replica = replica if self.across_dp and replica is not None and replica.world_size > 1 else None
        if self.replica is not None and self.group.world_size % self.replica.world_size:
            raise ValueError(
                f"ETP group of {self.group.world_size} ranks is not a whole number of DP replicas of "
                f"{self.replica.world_size} ranks."
            )
        start, end = storage.owned_rows(rows)
        self.table = PLETable(rows, dim, storage, start=start, end=end, shard_rows=shard_rows)

    def bytes_per_token(self, num_heads: int) -> int:
        """Bytes this rank moves per token of its own (across DP: per token of its replica, a multiple
        of the replica size)."""
        tp = self.replica.world_size if self.replica is not None else 1
        return self.combine_bytes(num_heads, tp) // tp

    def combine_bytes(self, num_heads: int, tokens: int) -> int:
        """Bytes this rank moves combining one step of `tokens` (across DP: the step's token bound)."""
        world = self.group.world_size if self.group is not None else 1
        tp = self.replica.world_size if self.replica is not None else 1
        return combine_bytes(world, self.across_dp, num_heads, self.table.dim, tokens, tp)

    def token_bound(self, tokens: int, max_tokens: int | None, device) -> int | None:
        """Across DP, the most tokens any rank holds this step: `max_tokens` when the caller knows it
        (every rank must pass the same), else exchanged here (a collective and a host sync). Every rank
        gets the same number, so capacity errors agree. None when the ranks hold the same tokens."""
        if not self.across_dp:
            return None
        if max_tokens is None:
            max_tokens = int(self.group.all_gather(torch.tensor([tokens], device=device), dim=0).max())
        if tokens > max_tokens:
            raise ValueError(f"this rank holds {tokens} tokens, more than max_tokens={max_tokens}.")
        return max_tokens

    def __call__(self, ids: torch.Tensor, out: torch.Tensor | None = None, max_tokens: int | None = None) -> torch.Tensor:
        """[T, H] row ids of this rank's tokens -> [T, H*d] bf16, into `out` if given."""
        g = self.group
        if g is None:
            return self.table.lookup(ids, out=out)
        if not self.across_dp:
            summed = g.all_reduce(self.table.lookup(ids, out=out))
            return summed if out is None or summed is out else out.copy_(summed)
        T = ids.shape[0]
        bound = self.token_bound(T, max_tokens, ids.device)
        tp, r = (self.replica.world_size, self.replica.rank_in_group) if self.replica is not None else (1, 0)
        s = -(-bound // tp)  # this rank's slice of its replica's tokens, padded to the largest
        mine = ids[min(r * s, T) : min((r + 1) * s, T)]
        padded = torch.full((s, ids.shape[1]), -1, dtype=ids.dtype, device=ids.device)
        padded[: mine.shape[0]] = mine
        summed = g.reduce_scatter(self.table.lookup(g.all_gather(padded, dim=0)), dim=0)  # [s, H*d]
        rows = self.replica.all_gather(summed, dim=0) if self.replica is not None else summed
        return rows[:T] if out is None else out.copy_(rows[:T])
