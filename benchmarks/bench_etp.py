"""ETP lookup time over NCCL with the releases' head geometry, per topology and tokens per rank.

    python -m benchmarks.bench_etp [--gpus 2] [--rows 3200000] [--tokens 64,256,2048] [--out benchmarks/results]

One process per GPU (rank = dp * TP + tp), pinned-host INT8 tables (16 heads x 128-wide rows + a bf16
scale). Topologies: TP over every GPU (one ETP group, the same tokens on each rank) and DP across every GPU
with `embedding_across_dp` (one ETP group, each rank its own tokens); from 4 GPUs also TP2 x DP, ETP within
the TP pairs and across DP over all ranks. Per token count: the eager ETP lookup, one GPU's eager lookup
from the whole host table, and the prefetch `start` + `wait` replayed from a CUDA graph (median of CUDA-event
times per call). Writes `bench_etp_{N}gpu.json` into `--out`; `benchmarks/plot_etp.py` draws it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import bench_config, capture, time_ms
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.etp import TorchGroup
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace
from qwen4_exp_hcu.ple.storage import PLEStorage

HEADS_PER_NGRAM, HEAD_DIM = 8, 128  # 16 heads at N = 3


def topologies(rank: int, world: int) -> list[tuple]:
    """This rank's (name, ETP group, across_dp, DP replica, replica group); every rank creates every
    subgroup, in the same order."""
    everyone = TorchGroup()
    cases = [(f"tp{world}", everyone, False, 0, None), (f"dp{world}_across", everyone, True, rank, None)]
    if world >= 4 and world % 2 == 0:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        pair, dp = TorchGroup(pairs[rank // 2]), rank // 2
        cases += [(f"tp2xdp{world // 2}", pair, False, dp, None), (f"tp2xdp{world // 2}_across", everyone, True, dp, pair)]
    return cases


def bench_case(cfg, dev, group, across, dp, replica, tokens, iters) -> dict:
    solo_storage = PLEStorage("int8", dev, host=True)
    etp = PLELayer(cfg, 0, replace(solo_storage, etp_group=group, across_dp=across, replica_group=replica))
    solo = PLELayer(cfg, 0, solo_storage)
    full = torch.randint(-127, 127, (solo.table.rows, solo.table.dim), dtype=torch.int8, device=dev, generator=torch.Generator(dev).manual_seed(0))
    solo.table.weight.copy_(full)
    etp.table.weight.copy_(full[etp.table.start : etp.table.end])
    for t in (solo.table, etp.table):
        t.scale.fill_(0.01)
    del full
    state = PLEState.zeros(solo.state_shapes(), 1, torch.bfloat16, dev)  # one slot; lookup reads its n-gram context
    H, steps = solo.spec.num_heads, []
    for T in tokens:
        seed = 1000 + T + (dp if across else 0)  # the TP ranks of one replica: the same tokens
        ids = torch.randint(0, cfg.vocab_size, (T,), device=dev, generator=torch.Generator(dev).manual_seed(seed))
        batch = PLEBatch(ids, torch.tensor([0, T], dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int64, device=dev),
                         torch.zeros(1, dtype=torch.bool, device=dev))  # fmt: skip
        bounded = replace(batch, max_tokens=T)
        assert torch.equal(etp.lookup(bounded, state), solo.lookup(batch, state)), "ETP lookup differs from one GPU's"
        ws = PrefetchWorkspace([etp], T, dev)

        def prefetch(handle=ws.handles[0]):
            handle.start(bounded, state)
            return handle.wait()

        graph, _ = capture(prefetch)
        dist.barrier()
        steps.append({
            "tokens_per_rank": T,
            "bytes_per_token": etp.etp.bytes_per_token(H),
            "etp_bytes_per_rank": etp.etp.combine_bytes(H, T),
            "table_rows_owned": etp.table.end - etp.table.start,
            "lookup_ms_etp_eager": time_ms(lambda: etp.lookup(bounded, state), iters),
            "lookup_ms_single_gpu_eager": time_ms(lambda: solo.lookup(batch, state), iters),
            "prefetch_ms_etp_graph": time_ms(graph.replay, iters),
        })
        del graph, ws, prefetch
    return {"dp": dp, "rows_total": solo.table.rows, "heads": H, "head_dim": solo.table.dim, "steps": steps}


def worker(rank: int, world: int, store: str, args) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=dev)
    cfg = bench_config(args.rows, HEADS_PER_NGRAM, HEAD_DIM)
    tokens = [int(t) for t in args.tokens.split(",")]
    cases = {}
    for name, group, across, dp, replica in topologies(rank, world):
        cases[name] = bench_case(cfg, dev, group, across, dp, replica, tokens, args.iters)
        if rank == 0:
            print(name, [(s["tokens_per_rank"], round(s["lookup_ms_etp_eager"], 3), round(s["prefetch_ms_etp_graph"], 3))
                         for s in cases[name]["steps"]], flush=True)  # fmt: skip
    result = {"rank": rank, "device": torch.cuda.get_device_name(dev), "cases": cases}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench_etp_{world}gpu.json").write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host": platform.node(),
            "devices": [r["device"] for r in gathered],
            "torch": torch.__version__,
            "nccl": str(torch.cuda.nccl.version()),
            "params": {"rows": args.rows, "heads_per_ngram": HEADS_PER_NGRAM, "head_dim": HEAD_DIM, "iters": args.iters},
            "per_rank": gathered,
        }, indent=1))  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2, help="ranks, one GPU each")
    ap.add_argument("--rows", type=int, default=3_200_000, help="table rows (about; the hash's per-head primes decide)")
    ap.add_argument("--tokens", default="64,256,2048", help="tokens per rank and step")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per figure; the median is kept")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: {torch.cuda.device_count()} GPUs here")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # keep NVLink multicast off
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args.gpus, os.path.join(tmp, "store"), args), nprocs=args.gpus, start_method="spawn")


if __name__ == "__main__":
    main()
