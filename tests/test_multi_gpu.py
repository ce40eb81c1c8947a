"""Two GPUs, NCCL: ETP lookup with pinned-host tables, prefetch inside a captured CUDA graph, exact.

One process per GPU (``cuda:{rank}``), running ``helpers.nccl_etp.nccl_worker``. Topologies: TP2 (one ETP group,
both ranks the same tokens) and DP2 with ``embedding_across_dp`` (one ETP group, different tokens per rank,
max_tokens = the graph's static token count). Tables in pinned host memory (``PLEStorage(host=True)``), read by
the fused kernel over UVA.

Per topology:
* eager, uneven real token counts (one step with none), prefetch off/on, max_tokens not passed/passed:
  every output and state equals a single-GPU reference (``PLELayer`` with group None, same GPU) bit for bit;
* CUDA graph: ``Prefetch.start`` + ``wait`` + ``forward`` of both PLE layers captured in one
  ``torch.cuda.graph`` (NCCL collectives on the side stream, warmed up eagerly before capture), replayed
  over prefill + decode steps with new inputs copied into static buffers (padding requests and tokens
  fill the static batch). Checked bit for bit against the reference captured the same way (same kernels,
  same shapes); the prefetched embeddings also bit for bit against an eager reference lookup, and the
  outputs against the eager reference forward within 1e-5 (eager vs graph may pick other GEMM kernels;
  the JSON records whether they were bitwise equal too).
Per-step ETP bytes and graph replay times of the tiny layers go to ``etp_2gpu.json`` in the directory
given by pytest's ``--results-dir`` (e.g. ``--results-dir benchmarks/results``); nothing is written without
it. Lookup times with the real head geometry: ``python -m benchmarks.bench_etp``.
"""

from __future__ import annotations

import pytest

from helpers.dist import Topology
from helpers.nccl_etp import run_nccl_workers, write_etp_results
from qwen4_exp_hcu.ple.etp import TorchGroup

pytestmark = pytest.mark.multi_gpu


def _topologies_2gpu(rank):
    """This rank's cases; called in the worker once all ranks joined."""
    group = TorchGroup()  # both ranks: the ETP group is the world of 2
    return (Topology("tp2", group, False, 0), Topology("dp2_across", group, True, rank))


def test_nccl_etp_prefetch_in_cuda_graph(tmp_path, results_dir):
    results, t0 = run_nccl_workers(tmp_path, 2, _topologies_2gpu)
    for name, bpt in (("tp2", 2 * 1 * 64 // 2), ("dp2_across", 1 * 4 * 8 + 1 * 64)):  # tiny: 4 heads x d=8
        assert all(r["cases"][name]["bytes_per_token"] == [bpt, bpt] for r in results), name
    # real geometry: 16 heads x 128 bf16 = 4096 B/token; TP2 all-reduce 2*(1/2)*4096; across 16*8 + 4096
    assert results[0]["cases"]["tp2"]["bytes_per_token_real_geometry"] == 4096
    assert results[0]["cases"]["dp2_across"]["bytes_per_token_real_geometry"] == 16 * 8 + 4096
    write_etp_results(
        results_dir, "etp_2gpu.json", "tests/test_multi_gpu.py::test_nccl_etp_prefetch_in_cuda_graph", results, t0,
        what_ran="TP2 and DP2-across-dp over NCCL, pinned-host tables, prefetch start+wait+forward in one CUDA graph; "
        "eager and graph outputs/states exact vs the single-GPU reference",
        bytes_note="bytes = per-rank ring volume of the ETP combine (ETPLookup.bytes_per_token x tokens per rank)",
    )
