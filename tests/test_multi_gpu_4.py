"""Four GPUs, NCCL: TP=2 x DP=2 ETP with prefetch inside captured CUDA graphs, exact vs one process.

The 2-GPU test's worker and checks (``helpers.nccl_etp.nccl_worker``) over a world of 4 (rank = dp * 2 + tp,
``cuda:{rank}``):
* ``tp2xdp2``: ``embedding_across_dp`` off; two ETP groups, the TP pairs {0, 1} and {2, 3} (``dist.new_group``);
  each table is split in halves within a pair, each DP replica runs its own tokens;
* ``tp2xdp2_across``: on; one ETP group of all 4 ranks (quarters of each table), the two ranks of a DP
  replica hold the same tokens, the replicas different ones (all-gather of ids + reduce-scatter of rows).
Each DP replica runs ``helpers.nccl_etp.NCCL_SCHEDULES[dp]``: uneven token counts per step (13/2, 2/7, 2/2, 0/4),
replica 0 with none in the last step. Per topology (``helpers.dist.Topology``): eager steps with
prefetch off/on and max_tokens not passed/exact, every output and state bit for bit vs the single-GPU
reference; then ``Prefetch.start`` + ``wait`` + ``forward`` of both PLE layers captured in one
CUDA graph, replayed over all steps with new inputs, bit for bit vs the reference graph (and the eager
reference lookup; forward within 1e-5 of eager). Per-step ETP bytes (``ETPLookup.bytes_per_token`` x
tokens) and replay times go to ``etp_4gpu.json`` in the directory given by pytest's ``--results-dir``
(e.g. ``--results-dir benchmarks/results``); nothing is written without it. Lookup times with the real head
geometry: ``python -m benchmarks.bench_etp --gpus 4``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.dist import Topology
from helpers.nccl_etp import NCCL_LAYERS, NCCL_MAX_T, NCCL_NSTEPS, NCCL_SCHEDULES, run_nccl_workers, write_etp_results
from qwen4_exp_hcu.ple.etp import TorchGroup, combine_bytes
from qwen4_exp_hcu.ple.storage import owned_rows

pytestmark = [
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs"),
]

WORLD, TP = 4, 2
# bytes per token per rank (ring volume): tiny layers 4 heads x d=8 (64 B rows, 32 B of ids); real geometry
# 16 heads x 128 (4096 B rows, 128 B of ids). TP pair: all-reduce 2(W-1)/W rows; across 4, per replica token:
# each TP rank sends half of them, (3 ids + 3 rows) / 2, and gathers the other half's rows in its pair, 1 row / 2.
BYTES_PER_TOKEN = {
    "tp2xdp2": (2 * 1 * 64 // 2, 4096),
    "tp2xdp2_across": ((3 * (32 + 64) + 64) // 2, (3 * (16 * 8 + 4096) + 4096) // 2),
}


def _topologies_tp2xdp2(rank):
    """This rank's cases; every rank creates both pair groups, in the same order."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = TorchGroup(pairs[rank // TP])
    return (
        Topology("tp2xdp2", pair, False, rank // TP),
        Topology("tp2xdp2_across", TorchGroup(), True, rank // TP, replica=pair),
    )


def _schedule_bytes(case, across):
    """Per eager step of this rank's replica: its tokens, the tokens the combine moves (across DP: the
    largest replica's, max_tokens passed) and the bytes that makes per rank."""
    rows = []
    for step in range(NCCL_NSTEPS):
        tokens = sum(n for _, n, _ in NCCL_SCHEDULES[case["dp"]][step])
        moved = NCCL_MAX_T[step] if across else tokens
        nbytes = len(case["bytes_per_token"]) * combine_bytes(WORLD if across else TP, across, 4, 8, moved, TP)
        rows.append({"step": step, "tokens": tokens, "combined_tokens": moved, "etp_bytes_per_rank": nbytes})
    return rows


def test_nccl_tp2xdp2_etp_prefetch_in_cuda_graph(tmp_path, results_dir):
    results, t0 = run_nccl_workers(tmp_path, WORLD, _topologies_tp2xdp2)
    for name, (tiny, real) in BYTES_PER_TOKEN.items():
        for r in results:
            case = r["cases"][name]
            assert case["dp"] == r["rank"] // TP, (name, r["rank"], case["dp"])
            assert case["bytes_per_token"] == [tiny] * len(NCCL_LAYERS), (name, case["bytes_per_token"])
            assert case["bytes_per_token_real_geometry"] == real, name
    # row ranges: halves within each TP pair without across-dp, quarters over the 4 ranks with it
    for i in range(len(NCCL_LAYERS)):
        pair = [r["cases"]["tp2xdp2"]["rows"][i] for r in results]
        n = pair[1][1]  # rank 1 owns the end of the table
        assert pair == [list(owned_rows(n, k % TP, TP)) for k in range(WORLD)], pair
        assert [r["cases"]["tp2xdp2_across"]["rows"][i] for r in results] == [list(owned_rows(n, k, WORLD)) for k in range(WORLD)]

    for r in results:
        for name, case in r["cases"].items():
            case["schedule_steps"] = _schedule_bytes(case, name.endswith("across"))
    write_etp_results(
        results_dir, "etp_4gpu.json", "tests/test_multi_gpu_4.py::test_nccl_tp2xdp2_etp_prefetch_in_cuda_graph", results, t0,
        what_ran="TP2 x DP2 over NCCL (4 ranks): ETP within the TP pairs (new_group) and across DP (one group of 4), "
        "pinned-host tables, uneven/zero tokens per DP replica, prefetch off/on eager and start+wait+forward in one "
        "CUDA graph replayed with new inputs; outputs/states exact vs the single-GPU reference",
        bytes_note="bytes = per-rank ring volume of the ETP combine (ETPLookup.bytes_per_token x tokens); "
        "schedule_steps: eager steps with max_tokens passed (without it across-dp adds an 8 B x 3 count exchange); "
        "graph_step: one replay of the static CAP-token graph; bytes_per_token_real_geometry: 16 heads x 128",
    )
