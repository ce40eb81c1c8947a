"""The file tier's promotions from traffic, as serving meets them: host time per lookup (ids to the host, misses
from the files into staging, and every `REFRESH_EVERY` lookups a promotion) with and without a cap on the
newcomers one promotion reads.

    python -m benchmarks.bench_file_promotions [--table-gb 2] [--share 0.2] [--prefill 4096 16384]
                                               [--decode 1 32] [--steps 2048] [--hot-rows-share 0.1]
                                               [--dir /tmp/file-tier] [--out benchmarks/results]

A promotion runs inside the lookup that triggers it. After long prefills every id they read is counted, and an
uncapped promotion reads all those rows from the files at once (a page fault per row): that step stalls. The run:
the prefills (natural text, benchmarks/data/text_tokens.safetensors), then `--steps` decode lookups per batch size,
for each cap side by side on the same table files (`common.write_table`'s, as bench_file_tier's, written once, read once first so the
page cache is warm for both). Reported per phase: mean,
median and largest ms per lookup, the promotions, and the slowest promotion's lookup. Then the same for a GPU
hot-row cache in front of the files (`--hot-rows-share` of the rows, on the CPU here): one refresh after the
prefills, capped (`hot_rows.REFRESH_ROWS`) and not, its newcomers read from the files. Writes JSON + PNG.
"""


from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import DIM, HEADS, SHARDS, bench_config, load_table, save, token_streams, write_table
from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
from qwen4_exp_hcu.ple.tiers.file_rows import PROMOTE_ROWS, FileTier
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.tiers.hot_rows import REFRESH_ROWS, HotRows
from qwen4_exp_hcu.ple.storage import PLEStorage

CAPS = {"uncapped": None, f"promote_rows={PROMOTE_ROWS}": PROMOTE_ROWS}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=2.0)
    ap.add_argument("--share", type=float, default=0.2, help="share of the table's bytes kept resident")
    ap.add_argument("--prefill", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--decode", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=2048, help="decode lookups per batch size (8 promotions)")
    ap.add_argument("--hot-rows-share", type=float, default=0.1, help="GPU hot-row cache in front, share of the rows")
    ap.add_argument("--dir", default="/tmp/file-tier")
    ap.add_argument("--out", default="benchmarks/results")
    return ap.parse_args()


def text_ids(args: argparse.Namespace, spec: NgramHashSpec) -> torch.Tensor:
    """The row ids `[tokens, heads]` of one natural text in order, as long as every phase's lookups together."""
    tokens = token_streams(sum(args.prefill) + sum(args.decode) * args.steps, torch.Generator().manual_seed(0))["text"]
    context = torch.full((1, spec.context_len), spec.eos_token_id)
    return ngram_ids(spec, tokens, torch.tensor([0, tokens.numel()]), context)


def phases(args: argparse.Namespace, ids: torch.Tensor) -> list[tuple[str, list[torch.Tensor]]]:
    """(name, lookups) in order: each prefill one lookup, then `--steps` decode lookups per batch size."""
    out, at = [], 0
    for n in args.prefill:
        out.append((f"prefill {n}", [ids[at : at + n]]))
        at += n
    for b in args.decode:
        out.append((f"decode b={b}", list(ids[at : at + b * args.steps].reshape(args.steps, b, HEADS))))
        at += b * args.steps
    return out


def measure_phase(table, cap_name: str, phase: str, steps: list[torch.Tensor]) -> dict:
    """Host ms of each lookup's staging, and those of the lookups that promoted."""
    ms, promoted = [], []
    for step in steps:
        before = table.file_rows.refreshes
        t0 = time.perf_counter()
        table.file_rows.stage(step)
        ms.append((time.perf_counter() - t0) * 1e3)
        if table.file_rows.refreshes > before:
            promoted.append(ms[-1])
    r = dict(cap=cap_name, phase=phase, lookups=len(ms), mean_ms=float(np.mean(ms)), median_ms=float(np.median(ms)),
             max_ms=float(np.max(ms)), promotions=len(promoted), slowest_promotion_ms=max(promoted, default=0.0),
             resident_share=table.file_rows.share)  # fmt: skip
    print(f"{cap_name:20} {phase:15} mean {r['mean_ms']:8.3f} ms  median {r['median_ms']:7.3f}  max {r['max_ms']:8.1f}  "
          f"promotions {len(promoted)} (slowest {r['slowest_promotion_ms']:.1f} ms)", flush=True)  # fmt: skip
    return r


def main() -> None:
    args = parse_args()
    spec = NgramHashSpec.from_config(bench_config(int(args.table_gb * 1e9) // (DIM + 2), HEADS // 2, DIM), 0)
    rows, shard_rows = spec.rows, -(-spec.rows // SHARDS)
    directory = Path(args.dir) / f"{args.table_gb:g}gb"
    write_table(directory, rows, shard_rows)
    ids = text_ids(args, spec)
    for f in directory.glob("*.safetensors"):  # page cache warm for both caps: the first would pay it alone
        f.read_bytes()
    results, hot_rows = [], []
    for cap_name, cap in CAPS.items():
        tier = FileTier(CheckpointFiles(directory), int(args.share * rows * (DIM + 2)), promote_rows=cap,
                        staging_rows=max(args.prefill) * HEADS)  # fmt: skip
        table = load_table(directory, rows, shard_rows, PLEStorage("int8", host=True, file_tier=tier))
        results += [measure_phase(table, cap_name, phase, steps) for phase, steps in phases(args, ids)]
        hot_rows.append(hot_row_refresh(table, ids[: sum(args.prefill)], args.hot_rows_share, capped=cap is not None))
        del table
    save(args.out, "file_promotions", report(args, rows, results, hot_rows), plot)


def report(args: argparse.Namespace, rows: int, results: list[dict], hot_rows: list[dict]) -> dict:
    return {
        "command": f"python -m benchmarks.bench_file_promotions --table-gb {args.table_gb:g} --share {args.share:g} "
                   f"--hot-rows-share {args.hot_rows_share:g} "
                   f"--prefill {' '.join(map(str, args.prefill))} --decode {' '.join(map(str, args.decode))} --steps {args.steps}",
        "machine": {"cpu": platform.processor() or "cpu", "cpus": os.cpu_count(), "torch": torch.__version__},
        "table": {"rows": rows, "heads": HEADS, "dim": DIM, "bytes": rows * (DIM + 2), "share": args.share},
        "results": results,
        "hot_row_refresh": hot_rows,
    }  # fmt: skip


def hot_row_refresh(table, prefill_ids: torch.Tensor, share: float, capped: bool) -> dict:
    """A hot-row cache (`share` of the rows) in front of the files, counting the prefills' ids, then one refresh:
    its newcomers come from the files. Timed with the cap (`hot_rows.REFRESH_ROWS`, or none) and with no newcomer
    at all (the top-k and bookkeeping, which run on the GPU in serving); the difference is the files' part."""
    rows = table.file_rows
    hot = HotRows(rows.mapped("weight"), rows.mapped("weight_scale"), table.start, int(share * rows.n), "cpu", observe=True)
    hot.refresh_every = 2**62  # refreshed by hand below
    hot.observe(prefill_ids)
    counts = hot.counts[:-1].clone()
    t0 = time.perf_counter()
    hot.refresh(counts, 0)
    bookkeeping = time.perf_counter() - t0
    limit = REFRESH_ROWS if capped else None
    t0 = time.perf_counter()
    hot.refresh(counts, limit)
    total = time.perf_counter() - t0
    r = dict(cap="uncapped" if limit is None else f"refresh_rows={limit}", slots=hot.rows.shape[0], copied=hot.filled,
             refresh_ms=total * 1e3, bookkeeping_ms=bookkeeping * 1e3, from_files_ms=(total - bookkeeping) * 1e3)  # fmt: skip
    print(f"hot-row refresh {r['cap']:20} {r['copied']} rows copied: {r['refresh_ms']:.1f} ms "
          f"({r['from_files_ms']:.1f} ms beyond the bookkeeping)", flush=True)  # fmt: skip
    return r


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    phases = list(dict.fromkeys(r["phase"] for r in report["results"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(CAPS)
    for i, cap in enumerate(CAPS):
        worst = [next(r["max_ms"] for r in report["results"] if r["cap"] == cap and r["phase"] == p) for p in phases]
        ax.bar(np.arange(len(phases)) + i * width, worst, width, label=cap)
    ax.set_xticks(np.arange(len(phases)) + width * (len(CAPS) - 1) / 2, phases)
    ax.set_yscale("log")
    ax.set_ylabel("slowest lookup, host side (ms)")
    ax.set_title(f"File-tier promotions, {report['table']['bytes'] / 1e9:.1f} GB table, {report['table']['share']:.0%} resident")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
