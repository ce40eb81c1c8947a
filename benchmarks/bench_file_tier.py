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
import json
import platform
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.bench_lookup import bench_config, token_streams
from benchmarks import drop_page_cache
from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
from qwen4_exp_hcu.ple.tiers.file_rows import FileTier
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

HEADS, DIM, SHARDS = 16, 160, 16
NAME = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_{}.weight"
SHARES = (1.0, 0.5, 0.2, 0.05)


def write_table(directory: Path, rows: int, shard_rows: int) -> None:
    """Random INT8 rows + bf16 scales, one safetensors file per shard (written once, reused)."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for j in range(-(-rows // shard_rows)):
        path = directory / f"model-{j:05d}.safetensors"
        if path.exists():
            continue
        n = min(shard_rows, rows - j * shard_rows)
        w = torch.randint(-127, 128, (n, DIM), dtype=torch.int8, generator=gen)
        s = (torch.rand(n, 1, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
        save_file({NAME.format(j): w, NAME.format(j) + "_scale": s}, str(path))


def load(directory: Path, rows: int, shard_rows: int, storage: PLEStorage) -> PLETable:
    table = PLETable(rows, DIM, storage, shard_rows=shard_rows)
    for j, path in enumerate(sorted(directory.glob("*.safetensors"))):
        t = load_file(path)
        table.load_shard(j, t[NAME.format(j)], t[NAME.format(j) + "_scale"], name=NAME.format(j))
    table.check_loaded()
    return table


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--calib-tokens", type=int, default=131072, help="tokens the resident rows are chosen from")
    ap.add_argument("--hot-rows-share", type=float, default=0.0, help="GPU hot-row cache, share of the rows")
    ap.add_argument("--dir", default="/tmp/file-tier")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.hot_rows_share and device == "cpu":
        raise SystemExit("--hot-rows-share: the hot-row cache lives in accelerator memory; this machine has none.")
    cfg = bench_config(int(args.table_gb * 1e9) // (DIM + 2), HEADS // 2, DIM)
    spec = NgramHashSpec.from_config(cfg, 0)
    rows, shard_rows = spec.rows, -(-spec.rows // SHARDS)
    directory = Path(args.dir) / f"{args.table_gb:g}gb"
    write_table(directory, rows, shard_rows)
    gen = torch.Generator().manual_seed(0)
    n = args.tokens * args.steps
    streams = token_streams(n + args.calib_tokens, gen)
    context = torch.full((1, spec.context_len), cfg.eos_token_id)

    def ids_of(tokens):
        return ngram_ids(spec, tokens.to(device), torch.tensor([0, tokens.numel()], device=device), context.to(device))

    whole = load(directory, rows, shard_rows, PLEStorage("int8", device=device, host=True))
    useful = args.tokens * HEADS * (DIM + 2)
    results = []
    for stream, tokens in streams.items():
        ids = ids_of(tokens[:n])
        steps = list(ids.reshape(args.steps, args.tokens, HEADS))
        calibration = ids_of(tokens[n:])  # the same stream's tokens that follow the measured ones
        base = timed_lookups(whole, steps)
        results.append(dict(stream=stream, share=None, phase="whole", s=base, gbps=useful / base / 1e9))
        print(f"{stream:8} whole table      {base * 1e3:8.3f} ms  {useful / base / 1e9:6.2f} GB/s", flush=True)
        for share in SHARES:
            tier = FileTier(CheckpointFiles(directory), int(share * whole.nbytes), refresh_every=0,
                            staging_rows=args.tokens * HEADS)  # fmt: skip
            table = load(directory, rows, shard_rows, PLEStorage("int8", device=device, host=True, file_tier=tier))
            if args.hot_rows_share:  # the GPU cache takes the most frequent rows; host memory the next ones
                table.enable_hot_rows(max(1, int(args.hot_rows_share * rows))).fill(calibration)
            served = table.fill_resident_rows(calibration)
            hits = float((torch.from_numpy(table.file_rows.slot_of)[ids.reshape(-1).cpu() - table.start] >= 0).float().mean())
            resident = int((table.file_rows.slot_row >= 0).sum())  # below the slots: the calibration, not the budget, binds
            gpu_hits = float((table.hot.slots_of(ids) >= 0).float().mean()) if table.hot else 0.0
            assert all(torch.equal(table.lookup(s), whole.lookup(s)) for s in steps[:4]), "file tier lookups differ"
            for f in directory.glob("*.safetensors"):
                drop_page_cache(f)
            for phase in ("cold", "warm"):
                t = timed_lookups(table, steps)
                staging = timed_staging(table, steps)
                results.append(dict(stream=stream, share=share, phase=phase, s=t, gbps=useful / t / 1e9,
                                    vs_whole=base / t, staging_s=staging, resident_hits=hits, calibration_served=served,
                                    resident_rows=resident, slots=table.file_rows.slots,
                                    hot_rows=args.hot_rows_share, gpu_hits=gpu_hits))  # fmt: skip
                print(f"{stream:8} {share:4.0%} resident {phase}  {t * 1e3:8.3f} ms  {useful / t / 1e9:6.2f} GB/s  "
                      f"{base / t:5.2f}x whole  host staging {staging * 1e3:.3f} ms  hits {hits:.0%} (+ GPU {gpu_hits:.0%})  "
                      f"resident {resident}/{table.file_rows.slots} rows", flush=True)  # fmt: skip
            del table
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"file_tier_{device}" + ("_hot" if args.hot_rows_share else "")
    report = {
        "command": f"python -m benchmarks.bench_file_tier --table-gb {args.table_gb:g} --tokens {args.tokens} "
                   f"--steps {args.steps} --calib-tokens {args.calib_tokens}"
                   + (f" --hot-rows-share {args.hot_rows_share:g}" if args.hot_rows_share else ""),
        "machine": {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                    "cpus": __import__("os").cpu_count(), "torch": torch.__version__},  # fmt: skip
        "table": {"rows": rows, "heads": HEADS, "dim": DIM, "bytes": whole.nbytes, "shards": SHARDS},
        "tokens_per_step": args.tokens, "steps": args.steps, "results": results,
    }
    (out / f"{tag}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{tag}.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
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
