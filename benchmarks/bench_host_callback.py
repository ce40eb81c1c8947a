"""A file-tier promotion as serving meets it: the C host function calls back into Python (`host_call.guarded`)
from a thread other than the engine's, while the engine's thread runs Python. Every numpy call in the promotion
gives up the GIL; the busy thread takes it, and the promotion waits up to a switch interval to get it back.
Timed side by side: the lookup that promotes, alone, beside a busy Python thread with the interpreter's default
switch interval, and beside it with the interval `guarded` sets while a callback runs.

    python -m benchmarks.bench_host_callback [--table-gb 1] [--tokens 256] [--refresh-every 64] [--repeats 5]
                                             [--dir /tmp/file-tier] [--out benchmarks/results/host_callback]

Writes host_callback.json + .png.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
from pathlib import Path
from statistics import median

import torch

from benchmarks.common import DIM, HEADS, SHARDS, load_table, save, write_table
from qwen4_exp_hcu.ple.tiers import host_call
from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
from qwen4_exp_hcu.ple.tiers.file_rows import FileTier
from qwen4_exp_hcu.ple.storage import PLEStorage

VARIANTS = {  # name -> (a busy Python thread beside it, the callback's switch interval)
    "alone": (False, host_call.CALLBACK_SWITCH_INTERVAL_S),
    "busy thread, default interval": (True, None),
    "busy thread, guarded's interval": (True, host_call.CALLBACK_SWITCH_INTERVAL_S),
}


def promotion_ms(table_dir: Path, rows: int, shard_rows: int, args, busy: bool) -> float:
    """ms of the lookup whose C host function promotes (the `refresh_every`-th), run on a worker thread as the
    driver runs it, with the calling thread spinning Python meanwhile when `busy`."""
    tier = FileTier(CheckpointFiles(table_dir), int(0.2 * rows * (DIM + 2)), refresh_every=args.refresh_every, staging_rows=HEADS * args.tokens)
    table = load_table(table_dir, rows, shard_rows, PLEStorage("int8", host=True, file_tier=tier))
    gen = torch.Generator().manual_seed(0)
    lookups = [torch.randint(0, rows, (args.tokens, HEADS), generator=gen) for _ in range(args.refresh_every)]
    for ids in lookups[:-1]:
        table.file_rows.stage(ids)
    took = []

    def promote():
        t0 = time.perf_counter()
        table.file_rows.stage(lookups[-1])
        took.append(time.perf_counter() - t0)

    worker = threading.Thread(target=promote)
    worker.start()
    spins = 0
    while busy and worker.is_alive():  # the engine's thread, in Python
        spins += 1
    worker.join()
    assert table.file_rows.refreshes == 1
    return took[0] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per lookup (x 16 heads)")
    ap.add_argument("--refresh-every", type=int, default=64, help="lookups per promotion")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/file-tier")
    ap.add_argument("--out", default="benchmarks/results/host_callback")
    args = ap.parse_args()
    rows = int(args.table_gb * 1e9) // (DIM + 2)
    shard_rows = -(-rows // SHARDS)
    table_dir = Path(args.dir) / f"{args.table_gb:g}gb-callback"
    write_table(table_dir, rows, shard_rows)
    default = host_call.CALLBACK_SWITCH_INTERVAL_S
    results = {}
    for name, (busy, interval) in VARIANTS.items():
        used = sys.getswitchinterval() if interval is None else interval
        host_call.CALLBACK_SWITCH_INTERVAL_S = used
        try:
            ms = [promotion_ms(table_dir, rows, shard_rows, args, busy) for _ in range(args.repeats)]
        finally:
            host_call.CALLBACK_SWITCH_INTERVAL_S = default
        results[name] = {"median_ms": median(ms), "ms": ms, "callback_switch_interval_s": used}
        print(f"{name:34s} {median(ms):8.1f} ms (median of {len(ms)})")
    report = {
        "command": "python -m benchmarks.bench_host_callback " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or "cpu", "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "table": {"rows": rows, "heads": HEADS, "dim": DIM, "ids_per_lookup": HEADS * args.tokens, "refresh_every": args.refresh_every},
        "results": results,
    }
    save(args.out, "host_callback", report, plot)


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, ax = plt.subplots(figsize=(7, 3))
    names = list(results)
    ax.barh(names, [results[n]["median_ms"] for n in names], color=["tab:gray", "tab:red", "tab:green"])
    ax.set_xlabel("ms of the lookup that promotes (median)")
    ax.set_title("file-tier promotion called back from the host function")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
