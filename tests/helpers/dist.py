"""Multi-process ETP tests: process groups, starting workers, a byte-counting group, comparing steps.

Workers are not forked from the test process (its OpenMP/CUDA state must not leak into them): they come
from a forkserver that has imported torch, transformers and the PLE modules once, so each worker starts in
well under a second instead of paying ~6 s of imports (compressed-tensors, transformers). Each worker writes
``rank{r}.json`` into a shared tmp dir, and a dying worker fails the test with its own traceback.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen4_exp_hcu.ple.storage import Group

PG_TIMEOUT_S = 60  # a rank stuck in a collective fails after this instead of hanging the suite
# imported once by the forkserver (it does not get the tests/ folder on sys.path, so only installed modules)
PRELOAD = [
    "torch", "torch.distributed", "pytest", "transformers", "transformers.models.qwen4_exp.configuration_qwen4_exp",
    "qwen4_exp_hcu.ple.layer", "qwen4_exp_hcu.ple.prefetch",
]


def init_process_group(backend: str, rank: int, world: int, tmp: str, device_id=None) -> None:
    """FileStore rendezvous in `tmp` (no ports to race for)."""
    kw = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S), **kw,
    )


def write_result(tmp: str, rank: int, result: dict) -> None:
    """A worker's result for `spawn_workers` (in the run's tmp dir, not a results file)."""
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare_steps(got: list, want: list, label: str, failures: list[str]) -> None:
    """Append a line per differing output / state: steps of (per-layer outputs, per-layer `PLEState`s)."""
    def diff(a, b):
        return f"max|diff| {max_abs_diff(a, b):.3g}" if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"

    for step, ((g_out, g_st), (w_out, w_st)) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(g_out, w_out, strict=True)):
            if not torch.equal(g, w):
                failures.append(f"{label}: step {step} layer {i} output differs ({diff(g, w)})")
            for name, a, b in (("ngram_state", g_st[i].ngram, w_st[i].ngram), ("conv_state", g_st[i].conv, w_st[i].conv)):
                if not torch.equal(a, b):
                    failures.append(f"{label}: step {step} layer {i} {name} differs ({diff(a, b)})")


def spawn_workers(fn, world: int, tmp: Path, *args, start_method: str = "forkserver") -> list[dict]:
    """Run ``fn(rank, world, str(tmp), *args)`` in `world` new processes; return each rank's result.
    A worker that raises (or dies) fails the calling test with the worker's traceback."""
    tmp.mkdir(parents=True, exist_ok=True)
    if start_method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)  # no effect once a forkserver runs (then workers import themselves)
    try:
        mp.start_processes(fn, args=(world, str(tmp), *args), nprocs=world, join=True, start_method=start_method)
    except mp.ProcessRaisedException as e:  # message carries the worker's formatted traceback
        pytest.fail(f"ETP worker raised:\n{e}", pytrace=False)
    except mp.ProcessExitedException as e:
        pytest.fail(f"ETP worker died: {e}", pytrace=False)
    results = []
    for r in range(world):
        f = tmp / f"rank{r}.json"
        if not f.exists():
            pytest.fail(f"ETP worker {r} exited without writing {f.name}")
        results.append(json.loads(f.read_text()))
    return results


class CountingGroup:
    """Wraps a `Group`; adds up the bytes each collective moves per rank under the ring algorithm
    (the volume `ETPLookup.bytes_per_token` describes): all-reduce 2(W-1)/W * n, all-gather (W-1) * n_in,
    reduce-scatter (W-1)/W * n_in."""

    def __init__(self, inner):
        self.inner = inner
        self.world_size, self.rank_in_group = inner.world_size, inner.rank_in_group
        self.bytes, self.calls = 0, []

    def _count(self, kind, x, num):
        self.bytes += num * x.numel() * x.element_size() // self.world_size
        self.calls.append((kind, tuple(x.shape)))

    def all_reduce(self, x):
        self._count("all_reduce", x, 2 * (self.world_size - 1))
        return self.inner.all_reduce(x)

    def all_gather(self, x, dim=-1):
        self._count("all_gather", x, (self.world_size - 1) * self.world_size)
        return self.inner.all_gather(x, dim)

    def reduce_scatter(self, x, dim=-1):
        self._count("reduce_scatter", x, self.world_size - 1)
        return self.inner.reduce_scatter(x, dim)

    def reset(self):
        self.bytes, self.calls = 0, []


@dataclass(frozen=True)
class Topology:
    """One ETP layout as one rank sees it (rank = dp * TP + tp)."""

    name: str  # the case's key in the results
    group: Group | None  # this rank's ETP group; None: every rank its whole table, nothing combined
    across_dp: bool  # embedding_across_dp: the group's ranks hold different tokens
    dp: int  # the DP replica whose tokens (schedule) this rank runs
    replica: Group | None = None  # across DP: the ranks of this rank's replica (its TP group)
