"""Plot the per-step ETP bytes and lookup times measured by ``benchmarks/bench_etp.py``.

``python -m benchmarks.bench_etp --gpus N`` writes ``benchmarks/results/bench_etp_{N}gpu.json``; this draws
the 2- and 4-GPU runs side by side (median over ranks) into ``etp.png``: ``python -m benchmarks.plot_etp``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TIMES = {
    "lookup_ms_etp_eager": ("ETP lookup, eager", "-"),
    "lookup_ms_single_gpu_eager": ("no ETP: whole host table, one GPU, eager", "--"),
    "prefetch_ms_etp_graph": ("ETP prefetch start+wait, CUDA graph", ":"),
}


def load_cases(paths: list[Path]) -> dict[str, list[dict]]:
    """``{"<file> <case>": [step, ...]}`` with every time the median over ranks."""
    cases = {}
    for path in paths:
        report = json.loads(path.read_text())
        ranks = report["per_rank"]
        for name in ranks[0]["cases"]:
            per_rank_steps = [r["cases"][name]["steps"] for r in ranks]
            steps = []
            for i, step in enumerate(per_rank_steps[0]):
                merged = {k: v for k, v in step.items() if k not in TIMES}
                for key in TIMES:
                    merged[key] = statistics.median(s[i][key] for s in per_rank_steps)
                steps.append(merged)
            cases[f"{len(ranks)}xGPU {name}"] = steps
    return cases


def plot(cases: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(14, 7))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (case, steps) in zip(colors, cases.items()):
        tokens = [s["tokens_per_rank"] for s in steps]
        for key, (label, style) in TIMES.items():
            ax_t.plot(tokens, [s[key] for s in steps], style, marker="o", color=color, label=f"{case}: {label}")
        ax_b.plot(tokens, [s["etp_bytes_per_rank"] / 2**20 for s in steps], marker="o", color=color,
                  label=f"{case} ({steps[0]['bytes_per_token']} B/token, {steps[0]['table_rows_owned']} rows owned)")
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank and step")
        ax.grid(alpha=0.3)
    ax_t.set_ylabel("ms per PLE lookup (median over ranks)")
    ax_t.set_title("H200 NVLink, NCCL, pinned-host INT8 table, 16 heads x 128")
    ax_t.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(0, -0.12))
    ax_b.set_yscale("log")
    ax_b.set_ylabel("ETP combine MiB per rank and step (ring volume)")
    ax_b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", nargs="*", type=Path,
                    default=[p for p in (RESULTS / "bench_etp_2gpu.json", RESULTS / "bench_etp_4gpu.json") if p.exists()])
    ap.add_argument("--out", type=Path, default=RESULTS / "etp.png")
    args = ap.parse_args()
    if not args.inputs:
        raise SystemExit("no bench_etp_*gpu.json: run `python -m benchmarks.bench_etp --gpus N` on GPUs first")
    cases = load_cases(args.inputs)
    plot(cases, args.out)
    for case, steps in cases.items():
        print(case, [(s["tokens_per_rank"], round(s["lookup_ms_etp_eager"], 3), round(s["prefetch_ms_etp_graph"], 3))
                     for s in steps])


if __name__ == "__main__":
    main()
