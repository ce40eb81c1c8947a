"""PLE lookups with rows read from the checkpoint's files (`ple.file_rows`) against the whole table in host memory.

    python -m benchmarks.bench_file_tier [--table-gb 2] [--tokens 256] [--steps 64] [--calib-tokens 131072]
                                         [--shares 1 0.5 0.2 0.05] [--streams text zipf1.1 uniform] [--read-around]
                                         [--phases cold cold_readahead warm]
                                         [--ask-pages-first never after_a_fault always] [--rounds 1]
                                         [--probe-reads 8192]
                                         [--hot-rows-share 0.01] [--dir /tmp/file-tier] [--out benchmarks/results]

Writes an INT8 table of `--table-gb` GB (16 heads x 160 values per row + one bf16 scale, the release's row; 13: one
TP4 rank's share of the release's table) as safetensors shards under `--dir`, then looks up the n-gram row ids of
`--tokens` tokens per step (a decode step of that batch) for `--steps` steps, on natural text
(benchmarks/data/text_tokens.safetensors), Zipf(1.1) and uniform token ids, with `--shares` of the table resident,
against the whole table pinned in host memory.

Resident rows: a calibrated start (`fill_resident_rows`, what `host_table_calibration` does) from the
`--calib-tokens` tokens of the same stream that follow the measured ones, extended with uniform token ids (a
document of their own) until the calibration holds a row for every slot of the largest budget below 100 %, so every
budget binds: each run reports its resident rows against the budget's slots, and the calibration's tokens.

Phases, each over the same steps:
  cold            before every lookup the files' pages are dropped (unmapped from the process, then
                  `posix_fadvise(DONTNEED)`: `page_cache`), and the maps' read-around is off, so every miss reads its
                  own pages from the drive and nothing else comes into the cache
  cold_readahead  (`--read-around`) the same with the maps as the file tier leaves them: a fault reads the kernel's
                  window around its page
  warm            the steps once untimed, then timed: their pages cached and mapped
(`--phases`: those named, in this order.)
`--ask-pages-first` (`FileTier.ask_pages_first`; default the tier's own): when a lookup asks the kernel for its
misses' pages (`MADV_WILLNEED`) before copying them; several: one table each, measured in turn within every phase.
`--rounds N` runs every phase of every table N times, interleaved (round, phase, table); each figure is then the
median of its rounds, with their min and max. Where pages were asked for first, a fault finds them read or in
flight, so the major faults (and the hit rate from them) no longer count the drive's reads: its bytes do;
`pages_asked` gives the pages a lookup asked for.
Reported per phase: ms per lookup (each lookup waited for; the drops are not timed), GB/s of useful bytes (row +
scale per token and head), the ratio to the whole table, the host side alone (ids to the host + rows from the files
into staging, timed in the same phase), the share of ids served by resident rows, and the page cache: the pages the
lookups' misses touched, the major faults (touches the cache did not hold), the hit rate, and the bytes read from
the drive (`/proc/self/io`, read-around included). `drive` holds the drive's own 4 KiB random-read rate over the
shard files (O_DIRECT, one read at a time and 16: `page_cache.random_read_rate`), the limit of reads that miss.
On an accelerator the lookup kernel reads over UVA; on the CPU the torch reference reads.
`--disk-offload-reference`: in the cold phase, every step's owned rows also read as vLLM 0.34's `disk_offload` reads
them (`page_cache.PreadvRows`; none resident), reported with `ask_pages_first` "vllm_disk_offload".
`--hot-rows-share S` (an accelerator): a GPU hot-row cache of S of the rows in front of every file-tier table, filled from the calibration
ids first; the resident rows then come from the calibration ids it does not serve (results carry `hot_rows`, files
`file_tier_{device}_hot.*`). Writes JSON + PNG into `--out`.
"""


from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (DIM, HEADS, REAL_VOCAB, SHARDS, bench_config, commit, drop_page_cache, load_table, save,
                               token_streams, write_table)  # fmt: skip
from benchmarks.page_cache import (IOCount, PreadvRows, cache_report, drop_mapped, mapped_read_rate, pages_needed,
                                   random_read_rate, read_around)  # fmt: skip
from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
from qwen4_exp_hcu.ple.tiers.file_rows import FileTier, resident_slots
from qwen4_exp_hcu.ple.tiers.stager import ASK_PAGES_FIRST
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

SHARES = (1.0, 0.5, 0.2, 0.05)
# phase -> (the files' pages dropped before every lookup, the maps' read-around on)
PHASES = {"cold": (True, False), "cold_readahead": (True, True), "warm": (False, True)}
PROBE_DEPTHS = (1, 16)  # reads in flight: one (a fault's) and enough to show the drive's parallel rate
ASK_FIRST = FileTier.__dataclass_fields__["ask_pages_first"].default  # the tier's own
DISK_OFFLOAD = "vllm_disk_offload"  # `--disk-offload-reference`'s row: vLLM 0.34's reads (`page_cache.PreadvRows`)


def waiter(ids: torch.Tensor):
    """What waits for the queued work on `ids`' device (nothing on the CPU, where lookups run at once)."""
    return torch.cuda.synchronize if ids.is_cuda else (lambda: None)


def each_step(steps: list[torch.Tensor], fn: Callable[[torch.Tensor], object], before=None) -> float:
    """Mean seconds of `fn(ids)` over the steps, each waited for (a step cannot start before its rows exist);
    `before()` runs ahead of each, untimed."""
    sync, took = waiter(steps[0]), 0.0
    for ids in steps:
        sync()
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn(ids)
        sync()
        took += time.perf_counter() - t0
    return took / len(steps)


def staging(table: PLETable) -> Callable[[torch.Tensor], object]:
    """The host side of a lookup alone: ids to the host, rows from the files into staging (on a GPU queued as a host
    function, `ple.host_call`: waited for with the step)."""

    def stage(ids: torch.Tensor):
        cached = None if table.hot is None else (table.hot.slots_of(ids) >= 0).view(ids.shape)  # never staged
        return table.file_rows.stage(ids, cached)

    return stage


def all_owned(table: PLETable, ids: torch.Tensor) -> np.ndarray:
    """The owned rows of one lookup, distinct: what a tier that keeps none resident reads."""
    local = ids.reshape(-1).cpu().numpy() - table.start
    return np.unique(local[(local >= 0) & (local < table.file_rows.n)])


def misses(table: PLETable, ids: torch.Tensor) -> np.ndarray:
    """The owned rows of one lookup that are read from the files: neither resident nor in the GPU hot-row cache."""
    local = ids.reshape(-1).cpu() - table.start
    keep = (local >= 0) & (local < table.file_rows.n)
    if table.hot is not None:
        keep &= (table.hot.slots_of(ids) < 0).reshape(-1).cpu()
    local = local[keep].numpy()
    return np.unique(local[table.file_rows.slot_of[local] < 0])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--calib-tokens", type=int, default=131072, help="tokens of the stream the resident rows are chosen from")
    ap.add_argument("--calib-max-tokens", type=int, default=1 << 24, help="tokens the calibration grows to at most")
    ap.add_argument("--shares", type=float, nargs="+", default=list(SHARES), help="shares of the table resident")
    ap.add_argument("--streams", nargs="+", choices=["text", "zipf1.1", "uniform"], help="token streams (default: all)")
    ap.add_argument("--read-around", action="store_true", help="also the cold_readahead phase")
    ap.add_argument("--phases", nargs="+", choices=list(PHASES), help="only these phases")
    ap.add_argument("--ask-pages-first", nargs="+", choices=ASK_PAGES_FIRST, default=[ASK_FIRST],
                    help="when the file tier asks for a lookup's missing pages before copying them (several: each)")
    ap.add_argument("--rounds", type=int, default=1, help="every phase of every table, interleaved, this often")
    ap.add_argument("--probe-reads", type=int, default=8192, help="4 KiB reads of the drive probe (0: none)")
    ap.add_argument("--hot-rows-share", type=float, default=0.0, help="GPU hot-row cache, share of the rows")
    ap.add_argument("--disk-offload-reference", action="store_true", help="in the cold phase, also every step's rows "
                    "read as vLLM 0.34's disk_offload reads them (none resident; results with ask_pages_first "
                    f"{DISK_OFFLOAD!r})")
    ap.add_argument("--label", help="what the JSON says the machine and its drive are")
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
    calibrations: dict = field(default_factory=dict)  # stream -> what its calibration held

    @property
    def useful(self) -> int:
        """Bytes a lookup reads for its result: a row and its scale per token and head."""
        return self.args.tokens * HEADS * (DIM + 2)

    @property
    def phases(self) -> list[str]:
        if self.args.phases:
            return [p for p in PHASES if p in self.args.phases]
        return [p for p in PHASES if p != "cold_readahead" or self.args.read_around]

    def slots(self, share: float) -> int:
        """Resident rows `share` of the table's bytes pays for."""
        return resident_slots(int(share * self.whole.nbytes), self.spec.rows, self.whole.nbytes // self.spec.rows)

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


def calibration(run: Setup, stream: str, tokens: torch.Tensor) -> torch.Tensor:
    """Row ids of the stream's calibration `tokens`, extended with uniform token ids (one document of their own)
    until they hold a row for every slot of the largest budget below the whole table (and of the GPU hot-row cache in
    front, which takes the most frequent first), or `--calib-max-tokens`; what they hold goes to the report."""
    need = max([run.slots(s) for s in run.args.shares if s < 1] or [0]) + int(run.args.hot_rows_share * run.spec.rows)
    ids, filler = run.ids(tokens), 0
    gen = torch.Generator().manual_seed(1)
    distinct = torch.unique(ids).numel()
    while distinct < need and tokens.numel() + filler < run.args.calib_max_tokens:
        n = min((need - distinct) // HEADS * 2 + 1024, run.args.calib_max_tokens - tokens.numel() - filler)
        ids = torch.cat([ids, run.ids(torch.randint(0, REAL_VOCAB, (n,), generator=gen))])
        filler += n
        distinct = torch.unique(ids).numel()
    run.calibrations[stream] = {"stream_tokens": tokens.numel(), "uniform_filler_tokens": filler,
                                "distinct_rows": distinct, "rows_needed": need}  # fmt: skip
    return ids


def file_tier_table(run: Setup, share: float, calibration: torch.Tensor, ask_first: str) -> tuple[PLETable, float]:
    """The table with `share` of its bytes resident and the rest read from the files (`ask_first`: its pages asked
    for first), its resident rows (and, with `--hot-rows-share`, a GPU hot-row cache in front) chosen from
    `calibration`; and the share of the calibration's ids the resident rows serve."""
    tier = FileTier(CheckpointFiles(run.directory), int(share * run.whole.nbytes), refresh_every=0,
                    staging_rows=run.args.tokens * HEADS, ask_pages_first=ask_first)  # fmt: skip
    table = run.table(PLEStorage("int8", device=run.device, host=True, file_tier=tier))
    if run.args.hot_rows_share:  # the GPU cache takes the most frequent rows; host memory the next ones
        table.enable_hot_rows(max(1, int(run.args.hot_rows_share * run.spec.rows))).fill(calibration)
    return table, table.fill_resident_rows(calibration)


def measure_phase(table: PLETable, steps: list[torch.Tensor], phase: str, drop: Callable[[], None]) -> dict:
    """One round of the steps' lookups, and of their host side alone, in one phase (`PHASES`); `drop()` forgets the
    files' pages (every table's maps of them), untimed, before each lookup of a cold phase."""
    cold, around = PHASES[phase]
    shards, area = table.file_rows.shards, table.file_rows.staging
    read_around(shards, around)
    try:
        if not cold:
            each_step(steps, table.lookup)  # the steps' pages cached and mapped
        before, asked = IOCount.now(), area.pages_asked
        seconds = each_step(steps, table.lookup, drop if cold else None)
        count, asked = IOCount.now() - before, (area.pages_asked - asked) / len(steps)
        return {"s": seconds, "staging_s": each_step(steps, staging(table), drop if cold else None), "io": count,
                "pages_asked": asked}  # fmt: skip
    finally:
        read_around(shards, True)


def measure_preadv(reader: PreadvRows, table: PLETable, steps: list[torch.Tensor], drop: Callable[[], None]) -> dict:
    """One round of the steps read as vLLM 0.34's `disk_offload` reads them (`page_cache.PreadvRows`: every owned row,
    none resident), cold: the files' pages dropped before each step, untimed."""
    before, seconds = IOCount.now(), []
    for ids in steps:
        rows = all_owned(table, ids)
        drop()
        t = time.perf_counter()
        reader.read(rows)
        seconds.append(time.perf_counter() - t)
    s = statistics.median(seconds)
    return {"s": s, "staging_s": s, "io": IOCount.now() - before, "pages_asked": 0}


def summary(rounds: list[dict], pages: int) -> dict:
    """A phase's rounds: seconds as the median with min, max and every round; the drive's reads of the median round
    against `pages`, the pages the misses touch."""
    s, staged = [r["s"] for r in rounds], [r["staging_s"] for r in rounds]
    io = IOCount(statistics.median_low(r["io"].read_bytes for r in rounds),
                 statistics.median_low(r["io"].major_faults for r in rounds))  # fmt: skip
    return {"s": statistics.median(s), "s_min": min(s), "s_max": max(s), "s_rounds": s,
            "staging_s": statistics.median(staged), "staging_s_min": min(staged), "staging_s_max": max(staged),
            "staging_s_rounds": staged, "pages_asked": statistics.median(r["pages_asked"] for r in rounds),
            **cache_report(io, pages)}  # fmt: skip


def measure_share(run: Setup, stream: str, share: float, steps: list[torch.Tensor], calibration: torch.Tensor,
                  base: float) -> list[dict]:  # fmt: skip
    """The lookups of `steps` with `share` of the table resident, one table per `--ask-pages-first`,
    checked against the whole table; every phase and variant in turn for `--rounds` rounds; `base`: the whole
    table's seconds per lookup."""
    tables = {ask: file_tier_table(run, share, calibration, ask) for ask in run.args.ask_pages_first}
    table, served = next(iter(tables.values()))
    rows = table.file_rows
    ids = torch.stack(steps).reshape(-1)
    hits = float((torch.from_numpy(rows.slot_of)[ids.cpu() - table.start] >= 0).float().mean())
    gpu_hits = float((table.hot.slots_of(ids) >= 0).float().mean()) if table.hot else 0.0
    for t, _ in tables.values():
        assert all(torch.equal(t.lookup(s), run.whole.lookup(s)) for s in steps[:4]), "file tier lookups differ"
    pages = sum(pages_needed(rows.shards, misses(table, s)) for s in steps)
    drop = partial(drop_mapped, *(t.file_rows.shards for t, _ in tables.values()))
    rounds = {(phase, ask): [] for phase in run.phases for ask in tables}
    reader = PreadvRows(rows.shards) if run.args.disk_offload_reference and "cold" in run.phases else None
    if reader:
        rounds["cold", DISK_OFFLOAD] = []
    for _ in range(run.args.rounds):
        for phase, ask in rounds:  # phase by phase, the tables in turn within each
            measured = measure_preadv(reader, table, steps, drop) if ask == DISK_OFFLOAD else measure_phase(tables[ask][0], steps, phase, drop)
            rounds[phase, ask].append(measured)
    if reader:
        reader.close()
    results = []
    for (phase, ask), measured in rounds.items():
        m = summary(measured, pages if ask != DISK_OFFLOAD else sum(pages_needed(rows.shards, all_owned(table, s)) for s in steps))
        results.append(dict(stream=stream, share=share, phase=phase, ask_pages_first=ask, **m, gbps=run.useful / m["s"] / 1e9,
                            vs_whole=base / m["s"], resident_hits=hits if ask != DISK_OFFLOAD else 0.0, calibration_served=served,
                            resident_rows=rows.filled, slots=rows.slots, hot_rows=run.args.hot_rows_share,
                            gpu_hits=gpu_hits))  # fmt: skip
        print(describe(results[-1], base), flush=True)
    return results


def describe(r: dict, base: float) -> str:
    """One line of a measured phase."""
    rounds = f" ({r['s_min'] * 1e3:.3f}-{r['s_max'] * 1e3:.3f})" if len(r["s_rounds"]) > 1 else ""
    return (f"{r['stream']:8} {r['share']:4.0%} resident {r['phase']:14} ask {r['ask_pages_first']:13} "
            f"{r['s'] * 1e3:8.3f} ms{rounds}  {base / r['s']:5.2f}x whole  host staging {r['staging_s'] * 1e3:.3f} ms  "
            f"hits {r['resident_hits']:.0%} (+ GPU {r['gpu_hits']:.0%})  {r['page_cache_hits']:.0%} of "
            f"{r['pages_needed']} pages without a major fault, drive {r['drive_read_bytes'] / 2**20:.1f} MiB, {r['pages_asked']:.0f} pages asked a "
            f"lookup  resident {r['resident_rows']}/{r['slots']} rows")  # fmt: skip


def measure_stream(run: Setup, stream: str, tokens: torch.Tensor) -> list[dict]:
    """The whole table's lookups of the stream's first `--steps` x `--tokens` tokens, then every share's; the
    resident rows are chosen from the same stream's tokens that follow the measured ones."""
    n = run.args.tokens * run.args.steps
    steps = list(run.ids(tokens[:n]).reshape(run.args.steps, run.args.tokens, HEADS))
    calib = calibration(run, stream, tokens[n:])
    base = each_step(steps, run.whole.lookup)
    print(f"{stream:8} whole table      {base * 1e3:8.3f} ms  {run.useful / base / 1e9:6.2f} GB/s  calibration "
          f"{run.calibrations[stream]}", flush=True)  # fmt: skip
    results = [dict(stream=stream, share=None, phase="whole", s=base, gbps=run.useful / base / 1e9)]
    for share in run.args.shares:
        results += measure_share(run, stream, share, steps, calib, base)
    return results


def drive_limit(run: Setup) -> dict:
    """The drive's 4 KiB random-read rate over the shard files, written pages flushed first (`PROBE_DEPTHS`), and the
    same pages read through maps: a fault at a time, as the file tier reads a cold miss, or all asked for first."""
    files = sorted(run.directory.glob("*.safetensors"))
    if not run.args.probe_reads:
        return {}
    for f in files:
        drop_page_cache(f)
    drive = {f"qd{d}": random_read_rate(files, run.args.probe_reads, d) for d in PROBE_DEPTHS}
    return {**drive, **{f"mapped{'_willneed' if p else ''}": mapped_read_rate(files, run.args.probe_reads, p) for p in (False, True)}}


def report(run: Setup, results: list[dict], drive: dict) -> dict:
    args = run.args
    return {
        "command": f"python -m benchmarks.bench_file_tier --table-gb {args.table_gb:g} --tokens {args.tokens} "
                   f"--steps {args.steps} --calib-tokens {args.calib_tokens} --shares {' '.join(f'{s:g}' for s in args.shares)}"
                   + (f" --streams {' '.join(args.streams)}" if args.streams else "")
                   + (" --read-around" if args.read_around else "") + (f" --phases {' '.join(args.phases)}" if args.phases else "")
                   + f" --ask-pages-first {' '.join(args.ask_pages_first)}"
                   + f" --rounds {args.rounds} --probe-reads {args.probe_reads}"
                   + (f" --hot-rows-share {args.hot_rows_share:g}" if args.hot_rows_share else "")
                   + (" --disk-offload-reference" if args.disk_offload_reference else "")
                   + (f" --label {shlex.quote(args.label)}" if args.label else ""),
        "commit": commit(),
        "machine": {"device": torch.cuda.get_device_name() if run.device == "cuda" else platform.processor() or "cpu",
                    "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                    "files": str(run.directory), **({"label": args.label} if args.label else {})},
        "table": {"rows": run.spec.rows, "heads": HEADS, "dim": DIM, "bytes": run.whole.nbytes, "shards": SHARDS},
        "tokens_per_step": args.tokens, "steps": args.steps, "rounds": args.rounds, "phases": {p: dict(zip(("drop_before_each_lookup", "read_around"), PHASES[p])) for p in run.phases},
        "calibration": run.calibrations, "drive": drive, "results": results,
    }  # fmt: skip


def main() -> None:
    run = setup(parse_args())
    drive = drive_limit(run)
    for name, d in drive.items():
        rate = f"{d['iops']:.0f} IOPS, {d['mb_per_s']:.1f} MB/s (O_DIRECT {d['o_direct']})" if "iops" in d else f"{d['pages_per_s']:.0f} pages/s"
        print(f"drive, 4 KiB random reads {name}: {rate}")
    streams = token_streams(run.args.tokens * run.args.steps + run.args.calib_tokens, torch.Generator().manual_seed(0))
    stem = f"file_tier_{run.device}" + ("_hot" if run.args.hot_rows_share else "")
    results = []
    for stream, tokens in streams.items():
        if stream in (run.args.streams or streams):
            results += measure_stream(run, stream, tokens)
            save(run.args.out, stem, report(run, results, drive), plot)  # after each stream: a cut run keeps what it measured


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    panels = ((lambda r: r["vs_whole"], "lookup speed vs whole table in host memory"),
              (lambda r: r["staging_s"] * 1e3, "host side of a lookup (ms)"),
              (lambda r: r["page_cache_hits"], "misses' pages touched without a major fault"),
              (lambda r: r["drive_read_bytes"] / r["needed_bytes"] if r["needed_bytes"] else None,
               "drive bytes read per byte of the misses' pages"))  # fmt: skip
    styles = {"warm": "-o", "cold": "--x", "cold_readahead": ":+"}
    tiered = [r for r in report["results"] if r["phase"] != "whole"]
    for stream, ask in dict.fromkeys((r["stream"], r["ask_pages_first"]) for r in tiered):
        for phase, style in styles.items():
            runs = [r for r in tiered if (r["stream"], r["ask_pages_first"], r["phase"]) == (stream, ask, phase)]
            for ax, (value, _) in zip(axes, panels):
                pts = [(r["share"] * 100, value(r)) for r in runs if value(r) is not None]
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{stream}, {phase}, ask {ask}")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    for ax, (_, label) in zip(axes, panels):
        ax.set_xscale("log")
        ax.set_xlabel("table resident in host memory (%)")
        ax.set_ylabel(label)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[3].set_yscale("symlog", linthresh=1)
    axes[3].set_ylim(bottom=0)
    axes[0].set_title(f"PLE rows from files, {report['table']['bytes'] / 1e9:.2f} GB INT8 table, {report['tokens_per_step']} tokens/step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
