"""PLE lookups with rows read from the checkpoint's files (`ple.file_rows`) against the whole table in host memory.

    python -m benchmarks.bench_file_tier [--table-gb 2] [--tokens 256] [--steps 64] [--calib-tokens 131072]
                                         [--hot-rows-share 0.01] [--dir /tmp/file-tier] [--out benchmarks/results]

Writes an INT8 table of `--table-gb` GB (16 heads x 160 values per row + one bf16 scale, the release's row) as
safetensors shards under `--dir`, then looks up the n-gram row ids of `--tokens` tokens per step (a decode step
of that batch) for `--steps` steps, on natural text (benchmarks/data/text_tokens.safetensors), Zipf(1.1) and
uniform token ids, with 100 / 50 / 20 / 5 % of the table resident (chosen from the `--calib-tokens` tokens of the
same stream that follow the measured ones), against the
whole table pinned in host memory. Cold: the files' page cache dropped first (`posix_fadvise(DONTNEED)`);
warm: the same steps again. Reported: ms per lookup, GB/s of useful bytes (row + scale per token and head),
the ratio to the whole table, the host side's share of the lookup (ids to the host + rows from the files into
staging, timed alone; "cold" times it after the cold lookups, so warm), the share of ids served by resident rows,
and the resident rows against the budget's slots (fewer: the calibration, not the budget, chose them). On an
accelerator the lookup kernel reads over UVA; on the CPU the torch reference reads. `--hot-rows-share S` (an accelerator): a GPU hot-row cache
of S of the rows in front of every file-tier table, filled from the calibration ids first; the resident rows then
come from the calibration ids it does not serve (results carry `hot_rows`, files `file_tier_{device}_hot.*`).
Writes JSON + PNG into `--out`.
"""


from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import (DIM, HEADS, SHARDS, bench_config, drop_page_cache, load_table, save, token_streams,
                               write_table)
from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
from qwen4_exp_hcu.ple.tiers.file_rows import FileTier
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

SHARES = (1.0, 0.5, 0.2, 0.05)


def waiter(ids: torch.Tensor):
    """What waits for the queued work on `ids`' device (nothing on the CPU, where lookups run at once)."""
    return torch.cuda.synchronize if ids.is_cuda else (lambda: None)


def timed_lookups(table: PLETable, steps: list[torch.Tensor]) -> float:
    """Mean seconds per lookup (each lookup waits for its result: a step cannot start before its rows exist)."""
    sync = waiter(steps[0])
    sync()
    t0 = time.perf_counter()
    for ids in steps:
        table.lookup(ids)
        sync()
    return (time.perf_counter() - t0) / len(steps)


def timed_staging(table: PLETable, steps: list[torch.Tensor]) -> float:
    """Mean seconds per lookup of the host side alone: ids to the host, rows from the files into staging (on a GPU
    queued as a host function, `ple.host_call`: timed until it has run)."""
    sync = waiter(steps[0])
    t0 = time.perf_counter()
    for ids in steps:
        cached = None if table.hot is None else (table.hot.slots_of(ids) >= 0).view(ids.shape)  # never staged
        table.file_rows.stage(ids, cached)
        sync()
    return (time.perf_counter() - t0) / len(steps)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--calib-tokens", type=int, default=131072, help="tokens the resident rows are chosen from")
    ap.add_argument("--hot-rows-share", type=float, default=0.0, help="GPU hot-row cache, share of the rows")
    ap.add_argument("--dir", default="/tmp/file-tier")
    ap.add_argument("--out", default="benchmarks/results")
    return ap.parse_args()


@dataclass
class Setup:
    """The table on disk, the whole of it in host memory, and the command line."""

    args: argparse.Namespace
    device: str
    spec: NgramHashSpec
    directory: Path
    shard_rows: int
    whole: PLETable | None = None

    @property
    def useful(self) -> int:
        """Bytes a lookup reads for its result: a row and its scale per token and head."""
        return self.args.tokens * HEADS * (DIM + 2)

    def table(self, storage: PLEStorage) -> PLETable:
        return load_table(self.directory, self.spec.rows, self.shard_rows, storage)

    def ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """The row ids of `tokens` as one request from a fresh context: `[tokens, HEADS]` on the device."""
        context = torch.full((1, self.spec.context_len), self.spec.eos_token_id, device=self.device)
        qsl = torch.tensor([0, tokens.numel()], device=self.device)
        return ngram_ids(self.spec, tokens.to(self.device), qsl, context)


def setup(args: argparse.Namespace) -> Setup:
    """The table written under `--dir` (once per size) and loaded whole into host memory."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.hot_rows_share and device == "cpu":
        raise SystemExit("--hot-rows-share: the hot-row cache lives in accelerator memory; this machine has none.")
    spec = NgramHashSpec.from_config(bench_config(int(args.table_gb * 1e9) // (DIM + 2), HEADS // 2, DIM), 0)
    run = Setup(args, device, spec, Path(args.dir) / f"{args.table_gb:g}gb", -(-spec.rows // SHARDS))
    write_table(run.directory, spec.rows, run.shard_rows)
    run.whole = run.table(PLEStorage("int8", device=device, host=True))
    return run


def file_tier_table(run: Setup, share: float, calibration: torch.Tensor) -> tuple[PLETable, int]:
    """The table with `share` of its bytes resident and the rest read from the files, its resident rows (and, with
    `--hot-rows-share`, a GPU hot-row cache in front) chosen from `calibration`; and how many calibration ids the
    resident rows serve."""
    tier = FileTier(CheckpointFiles(run.directory), int(share * run.whole.nbytes), refresh_every=0,
                    staging_rows=run.args.tokens * HEADS)  # fmt: skip
    table = run.table(PLEStorage("int8", device=run.device, host=True, file_tier=tier))
    if run.args.hot_rows_share:  # the GPU cache takes the most frequent rows; host memory the next ones
        table.enable_hot_rows(max(1, int(run.args.hot_rows_share * run.spec.rows))).fill(calibration)
    return table, table.fill_resident_rows(calibration)


def measure_share(run: Setup, stream: str, share: float, steps: list[torch.Tensor], calibration: torch.Tensor,
                  base: float) -> list[dict]:  # fmt: skip
    """The lookups of `steps` with `share` of the table resident, cold (the files' page cache dropped) then warm,
    checked against the whole table; `base`: the whole table's seconds per lookup."""
    table, served = file_tier_table(run, share, calibration)
    ids = torch.stack(steps).reshape(-1)
    hits = float((torch.from_numpy(table.file_rows.slot_of)[ids.cpu() - table.start] >= 0).float().mean())
    resident = int((table.file_rows.slot_row >= 0).sum())  # below the slots: the calibration, not the budget, binds
    gpu_hits = float((table.hot.slots_of(ids) >= 0).float().mean()) if table.hot else 0.0
    assert all(torch.equal(table.lookup(s), run.whole.lookup(s)) for s in steps[:4]), "file tier lookups differ"
    for f in run.directory.glob("*.safetensors"):
        drop_page_cache(f)
    results = []
    for phase in ("cold", "warm"):
        t = timed_lookups(table, steps)
        staging = timed_staging(table, steps)
        results.append(dict(stream=stream, share=share, phase=phase, s=t, gbps=run.useful / t / 1e9, vs_whole=base / t,
                            staging_s=staging, resident_hits=hits, calibration_served=served, resident_rows=resident,
                            slots=table.file_rows.slots, hot_rows=run.args.hot_rows_share, gpu_hits=gpu_hits))  # fmt: skip
        print(f"{stream:8} {share:4.0%} resident {phase}  {t * 1e3:8.3f} ms  {run.useful / t / 1e9:6.2f} GB/s  "
              f"{base / t:5.2f}x whole  host staging {staging * 1e3:.3f} ms  hits {hits:.0%} (+ GPU {gpu_hits:.0%})  "
              f"resident {resident}/{table.file_rows.slots} rows", flush=True)  # fmt: skip
    return results


def measure_stream(run: Setup, stream: str, tokens: torch.Tensor) -> list[dict]:
    """The whole table's lookups of the stream's first `--steps` x `--tokens` tokens, then every share's; the
    resident rows are chosen from the same stream's tokens that follow the measured ones."""
    n = run.args.tokens * run.args.steps
    steps = list(run.ids(tokens[:n]).reshape(run.args.steps, run.args.tokens, HEADS))
    calibration = run.ids(tokens[n:])
    base = timed_lookups(run.whole, steps)
    print(f"{stream:8} whole table      {base * 1e3:8.3f} ms  {run.useful / base / 1e9:6.2f} GB/s", flush=True)
    results = [dict(stream=stream, share=None, phase="whole", s=base, gbps=run.useful / base / 1e9)]
    for share in SHARES:
        results += measure_share(run, stream, share, steps, calibration, base)
    return results


def report(run: Setup, results: list[dict]) -> dict:
    args = run.args
    return {
        "command": f"python -m benchmarks.bench_file_tier --table-gb {args.table_gb:g} --tokens {args.tokens} "
                   f"--steps {args.steps} --calib-tokens {args.calib_tokens}"
                   + (f" --hot-rows-share {args.hot_rows_share:g}" if args.hot_rows_share else ""),
        "machine": {"device": torch.cuda.get_device_name() if run.device == "cuda" else platform.processor() or "cpu",
                    "cpus": os.cpu_count(), "torch": torch.__version__},
        "table": {"rows": run.spec.rows, "heads": HEADS, "dim": DIM, "bytes": run.whole.nbytes, "shards": SHARDS},
        "tokens_per_step": args.tokens, "steps": args.steps, "results": results,
    }  # fmt: skip


def main() -> None:
    run = setup(parse_args())
    streams = token_streams(run.args.tokens * run.args.steps + run.args.calib_tokens, torch.Generator().manual_seed(0))
    results = [r for stream, tokens in streams.items() for r in measure_stream(run, stream, tokens)]
    save(run.args.out, f"file_tier_{run.device}" + ("_hot" if run.args.hot_rows_share else ""), report(run, results), plot)


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for stream in dict.fromkeys(r["stream"] for r in report["results"]):
        for phase, style in (("warm", "-o"), ("cold", "--x")):
            pts = [(r["share"] * 100, r["vs_whole"]) for r in report["results"] if r["stream"] == stream and r["phase"] == phase]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{stream}, {phase}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("table resident in host memory (%)")
    ax.set_ylabel("lookup speed vs whole table in host memory")
    ax.set_title(f"PLE rows from files, {report['table']['bytes'] / 1e9:.1f} GB INT8 table, {report['tokens_per_step']} tokens/step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
