"""Per-rank PLE memory and per-step traffic for a config and a TP x DP layout (no GPU needed).

    python -m benchmarks.plan_memory [--config CKPT_OR_CONFIG_JSON] [--num-ple-layers 1] [--tokens 256]
                                     [--gpus-per-node 8] [--hot-rows-gib 0] [--host-table-gib 0]
                                     [--host-ram-gib 0 [--host-reserve-gib 0]]

Without --config the transformers defaults are used (vocab 248 320, hidden 2048, N=3, 8 heads per order,
base 20 M rows per head) with `--num-ple-layers` PLE layers. For every TP in 1..8 and DP in 1..8 it
reports, per rank: table bytes (BF16 vs INT8+scale) on the GPU or in host memory, and per step with
`--tokens` tokens per DP rank: host->GPU (PCIe) bytes of the offloaded lookup and ETP combine bytes,
with and without `embedding_across_dp` — across DP ours (each TP rank sends a 1/TP slice of its replica's
tokens) beside upstream vLLM's (DP gather of ids + all-reduce over TP x DP). Per node (`--gpus-per-node`
ranks): INT8 host bytes without and with `dp_shared_memory` (one copy of the TP-sharded tables for all DP
replicas on the node). Per rank on the GPU beside host tables: the row scales when kept there
(`PLEStorage(scales_on_device=True)`) and the hot-row cache serving's `hot_rows_gib` setting gives it, with
the rows that budget caches once the row maps are paid (filled from traffic, which also keeps counts, or
from a calibration file). With `--host-table-gib G` (serving's `host_table_gib`, the file tier): per rank the
pinned bytes of the resident rows (+ one staging area per layer for every id of a `--max-num-batched-tokens`
step, and its ids, 17 B each, that the host function reads and writes), the bytes left in the checkpoint's
files, the pageable host bytes of the row maps (4 B per owned row and per resident row, the host function's
table of a lookup's misses, + 4 B of counts per owned row and up to 8 MB of promotion candidates per layer when
following traffic) and the GPU bytes of the tables (none: scales stay with their rows).
With `--host-ram-gib R` (a node's host RAM, less `--host-reserve-gib` for the OS and the engine processes, which
nothing here counts): per layout, whether the whole INT8 table fits pinned (each rank's own copy, or one per node with
`dp_shared_memory`), else the `host_table_gib` to set: the largest budget whose resident rows, staging areas and row
maps fit each rank's share of the RAM (following traffic, and with `host_table_calibration`, whose maps are smaller),
and the decode speed measured at that share of the table: read from the serving result files docs/PERFORMANCE.md
cites (`benchmarks.figures`) whose budgets bound, named; where none was measured at that share it says so, and
names the nearest measured share below. Beside it, the decode the drive allows when every miss reads it: the cold
lookups measured on the GPU machine's drive (pages a token, pages a second) added to the pinned table's decode steps.
Writes benchmarks/results/plan_memory.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from qwen4_exp_hcu.ple.etp import combine_bytes, looked_up_tokens
from qwen4_exp_hcu.ple.tiers.file_rows import index_bytes, resident_slots
from qwen4_exp_hcu.ple.tiers.staging import IO_DTYPES
from qwen4_exp_hcu.ple.storage import owned_rows
from qwen4_exp_hcu.ple.hashing import NgramHashSpec
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows


def upstream_bytes_per_token(world: int, dp: int, num_heads: int, dim: int) -> float:
    """Upstream vLLM's across-DP combine, per replica token: ids all-gathered over DP, rows all-reduced
    over the TP x DP group."""
    row = num_heads * dim * 2
    return (dp - 1) * num_heads * 8 + 2 * (world - 1) / world * dp * row


def load_config(path: str | None, num_ple_layers: int):
    from transformers import AutoConfig, Qwen4ExpTextConfig

    if path:
        cfg = AutoConfig.from_pretrained(path)
        return getattr(cfg, "text_config", None) or cfg
    layers = list(range(1, 4 * num_ple_layers, 4))  # 1-indexed linear-attention layers
    return Qwen4ExpTextConfig(ple_layer_ids=layers, eos_token_id=248_044)


def file_tier_bytes(per_layer: list[int], row_bytes: int, host_table_bytes: int, hot_rows_bytes: int, staging_rows: int) -> dict:
    """Per-rank bytes of the file tier over this rank's owned rows of each PLE layer (INT8 rows), with a staging
    area of `staging_rows` per layer (serving: every id of the largest step) with its pinned ids; the GPU holds
    the hot-row cache in front of it, if any."""
    budget = host_table_bytes // len(per_layer)
    slots = [resident_slots(budget, n, row_bytes) for n in per_layer]
    resident = sum(slots)
    staging = len(per_layer) * staging_rows * (row_bytes + sum(t.itemsize for t in IO_DTYPES.values()))
    return {
        "file_tier_pinned_bytes_per_rank": resident * row_bytes + staging,
        "file_tier_file_bytes_per_rank": (sum(per_layer) - resident) * row_bytes,
        "file_tier_host_map_bytes_per_rank": sum(index_bytes(n, s, staging_rows, False) for n, s in zip(per_layer, slots)),
        "file_tier_host_map_bytes_per_rank_from_traffic": sum(index_bytes(n, s, staging_rows, True) for n, s in zip(per_layer, slots)),
        "file_tier_gpu_bytes_per_rank": hot_rows_bytes,
    }


def plan(cfg, tokens: int, gpus_per_node: int = 8, hot_rows_bytes: int = 0, host_table_bytes: int = 0,
         max_step_tokens: int = 8192, host_ram_bytes: float = 0, measured: list[dict] | None = None) -> list[dict]:
    specs = [NgramHashSpec.from_config(cfg, i) for i in range(len(cfg.ple_layer_ids))]
    heads, dim = specs[0].num_heads, specs[0].head_dim
    rows = [s.rows for s in specs]
    out = []
    for tp in range(1, 9):
        for dp in range(1, 9):
            for across in (False, True) if dp > 1 else (False,):
                world = tp * dp if across else tp
                per_layer = [owned_rows(r, 0, world)[1] for r in rows]  # rank 0 owns the most
                owned = sum(per_layer)
                budget = hot_rows_bytes // len(rows)
                slots = {observe: sum(max(0, HotRows.slots_for(budget, n, dim + 2, observe)) for n in per_layer)
                         for observe in (True, False)} if budget else {True: 0, False: 0}  # fmt: skip
                row = {
                    "tp": tp, "dp": dp, "embedding_across_dp": across, "etp_world": world,
                    "bf16_table_bytes_per_rank": owned * dim * 2,
                    "int8_table_bytes_per_rank": owned * (dim + 2),
                    **node_bytes(rows, dim, tp, dp, across, gpus_per_node),
                    "gpu_bytes_per_rank_host_int8_device_scales": owned * 2 + hot_rows_bytes,
                    "hot_rows_per_rank_from_traffic": slots[True],
                    "hot_rows_per_rank_from_calibration": slots[False],
                    # ids an ETP rank looks up per step: its DP replica's tokens, or every replica's
                    "pcie_bytes_per_step_int8": round(len(rows) * tokens * heads * (dim + 2) * (dp if across else 1) / world),
                    "etp_bytes_per_step": len(rows) * combine_bytes(world, across, heads, dim, tokens, tp),
                    "etp_bytes_per_step_upstream": round(
                        len(rows) * tokens * (upstream_bytes_per_token(world, dp, heads, dim) if across else 2 * (tp - 1) / tp * heads * dim * 2)
                    ),
                    **(file_tier_bytes(per_layer, dim + 2, host_table_bytes, hot_rows_bytes,
                                       looked_up_tokens(world, across, max_step_tokens, tp) * heads)
                       if host_table_bytes else {}),
                }
                if host_ram_bytes:
                    row["host_ram"] = host_ram_advice(row, per_layer, dim + 2, looked_up_tokens(world, across, max_step_tokens, tp) * heads,
                                                      host_ram_bytes, gpus_per_node, measured or [])  # fmt: skip
                out.append(row)
    return out


RESULTS = Path(__file__).resolve().parent / "results"
# bench_serve's file-tier variants (resident rows following the traffic, or calibrated), by prompt source
FILES_VARIANT = re.compile(r"^host_int8_files(\d+)(_calibrated)?((?:@[\w-]+)*)$")  # @SOURCE, @cold-reads
SAME_SHARE = 0.005  # a measured share this close to a budget's counts as measured at it


def file_tier_host_bytes(per_layer: list[int], row_bytes: int, host_table_bytes: int, staging_rows: int,
                         traffic: bool) -> int:  # fmt: skip
    """Host bytes per rank of the file tier at a `host_table_gib` of `host_table_bytes`: resident rows and staging
    (pinned) and the row maps (pageable), those of traffic's counts and candidates with `traffic`."""
    b = file_tier_bytes(per_layer, row_bytes, host_table_bytes, 0, staging_rows)
    return b["file_tier_pinned_bytes_per_rank"] + b["file_tier_host_map_bytes_per_rank" + ("_from_traffic" if traffic else "")]


def largest_budget(ram: float, per_layer: list[int], row_bytes: int, staging_rows: int, traffic: bool) -> int | None:
    """The largest `host_table_gib` bytes (whole rows in every layer) whose file tier fits `ram` bytes; None where
    the staging areas and row maps alone do not fit."""
    layers = len(per_layer)

    def fits(rows: int) -> bool:
        return file_tier_host_bytes(per_layer, row_bytes, rows * row_bytes * layers, staging_rows, traffic) <= ram

    if not fits(0):
        return None
    lo, hi = 0, max(per_layer)  # rows per layer: fits(lo), and no more than every owned row
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * row_bytes * layers


def serve_files() -> list[str]:
    """The serving result files docs/PERFORMANCE.md cites (`benchmarks.figures`): the current measurements."""
    from benchmarks.figures import FAMILIES

    return sorted({f for _, rows in FAMILIES for row in rows for f in row.files if f.endswith("bench_serve.json")})


def _described(result: dict) -> dict:
    """A file-tier engine's resident rows against its slots, and its table's rows, from the table's description."""
    text = " ".join(result.get("bytes", {}).get("ple_tables", []))
    resident, rows = re.search(r"(\d+)/(\d+) rows resident", text), re.search(r"rows \[(\d+), (\d+)\)", text)
    return {"resident_slots": (int(resident[1]), int(resident[2])) if resident else None,
            "table_rows": int(rows[2]) - int(rows[1]) if rows else None}  # fmt: skip


def measured_decode(results: Path = RESULTS) -> list[dict]:
    """Every file-tier serving variant in `serve_files()`: its share of the table, prompts, decode tokens/s by batch
    against the whole table pinned (`host_int8` with the same prompts, from the same file or one of its session's),
    and its resident rows against its slots (fewer: the budget did not bind in that run)."""
    docs = {name: json.loads((results / name).read_text()) for name in serve_files() if (results / name).exists()}
    found = []
    for name, doc in docs.items():
        session = Path(name).parent.parent
        refs = [name] + [n for n in docs if n != name and session != Path(".") and Path(n).parent.parent == session]
        for key, r in doc["results"].items():
            if not (m := FILES_VARIANT.match(key)) or "decode_tokens_per_s" not in r:
                continue
            whole = f"host_int8{m[3]}"
            ref = next(((n, docs[n]["results"][whole]) for n in refs if whole in docs[n]["results"]), None)
            ratios = {b: v / ref[1]["decode_tokens_per_s"][b] for b, v in r["decode_tokens_per_s"].items()} if ref else None
            found.append({"file": name, "variant": key, "share": int(m[1]) / 100, "prompts": r.get("prompts", "uniform"),
                          "calibrated": bool(m[2]), "cold_reads": "@cold-reads" in m[3],
                          "gpu": doc.get("machine", {}).get("gpu"), "graph_mode": doc.get("graph_mode"),
                          "decode_tokens_per_s": r["decode_tokens_per_s"], "whole_table_file": ref and ref[0],
                          "decode_vs_whole_table": ratios, **_described(r)})  # fmt: skip
    return found


def expected_decode(share: float, measured: list[dict], ple_layers: int = 1) -> dict:
    """The decode measured at `share` of the table, in runs whose budget bound (a run holding fewer rows than its
    slots measured no budget); where none was, a note saying so and the nearest share below; and the decode the
    drive allows there (`drive_bound_decode`)."""
    bound = [m for m in measured if m["resident_slots"] and m["resident_slots"][0] == m["resident_slots"][1]]
    drive = drive_bound_decode(share, ple_layers)
    at = [m for m in bound if abs(m["share"] - share) < SAME_SHARE]
    if at:
        return {"measured": at, "drive_bound": drive}
    below = [m for m in bound if m["share"] < share]
    nearest = max((m["share"] for m in below), default=None)
    return {"measured": [], "note": f"no GPU measurement with the budget bound at {share:.1%} of the table yet",
            "nearest_below": [m for m in below if m["share"] == nearest], "drive_bound": drive}  # fmt: skip


# Cold lookups on the GPU machine's drive (bench_file_tier, the TP4 rank's table at 20 and 5 %), and the whole table
# pinned decoding on the H200 at the release geometry, one PLE layer: what `drive_bound_decode` reads.
DRIVE_LOOKUPS = "file_tier_gpu_13gb_cold/file_tier_cuda.json"
PINNED_DECODE = ("serve_release_034_disk_tiers/bench_serve.json", "host_int8@cold-reads")


def drive_bound_decode(share: float, ple_layers: int = 1, results: Path = RESULTS) -> dict | None:
    """Decode against the whole table pinned when every missed row reads the drive, from measurements: the pages a
    token's lookup missed in `DRIVE_LOOKUPS` at the nearest measured share at or below `share` (fewer rows
    resident: more misses), read at the pages a second the tier reached there, added to each step of
    `PINNED_DECODE` for every PLE layer, with no overlap. None where no share at or below was measured."""
    lookups = json.loads((results / DRIVE_LOOKUPS).read_text())
    tier = [r for r in lookups["results"] if r["phase"] == "cold" and r["ask_pages_first"] != "vllm_disk_offload"]
    measured = max((r["share"] for r in tier if r["share"] <= share + SAME_SHARE), default=None)
    if measured is None:
        return None
    pinned = json.loads((results / PINNED_DECODE[0]).read_text())["results"][PINNED_DECODE[1]]["decode_tokens_per_s"]
    step = {b: int(b) / rate for b, rate in pinned.items()}  # seconds a decode step, by batch
    streams = {}
    for r in (r for r in tier if r["share"] == measured):
        lookup_pages = r["pages_needed"] / lookups["steps"]
        pages_per_token, pages_per_s = lookup_pages / lookups["tokens_per_step"], lookup_pages / r["staging_s"]
        streams[r["stream"]] = {
            "pages_per_token": pages_per_token, "pages_per_s": pages_per_s, "resident_hits": r["resident_hits"],
            "decode_vs_whole_table": {b: s / (s + int(b) * pages_per_token * ple_layers / pages_per_s) for b, s in step.items()},
        }  # fmt: skip
    return {"share_measured": measured, "files": [DRIVE_LOOKUPS, PINNED_DECODE[0]],
            "device": lookups["machine"]["device"], "streams": streams}


def host_ram_advice(row: dict, per_layer: list[int], row_bytes: int, staging_rows: int, host_ram: float,
                    gpus_per_node: int, measured: list[dict]) -> dict:  # fmt: skip
    """What to set on a node of `host_ram` bytes (the reserve already taken) for one layout of `plan`."""
    ranks = min(row["tp"] * row["dp"], gpus_per_node)
    out = {"ranks_on_node": ranks, "host_ram_bytes_per_rank": host_ram / ranks,
           "whole_table_fits": row["host_bytes_per_node_int8"] <= host_ram,
           "whole_table_fits_dp_shared": row["host_bytes_per_node_int8_dp_shared"] <= host_ram}  # fmt: skip
    if out["whole_table_fits"]:
        return out
    budgets = {t: largest_budget(host_ram / ranks, per_layer, row_bytes, staging_rows, t) for t in (True, False)}
    table = row["int8_table_bytes_per_rank"]
    share = None if budgets[True] is None else budgets[True] / table
    return {**out, "host_table_gib": None if budgets[True] is None else math.floor(budgets[True] / 2**30 * 100) / 100,
            "host_table_gib_calibrated": None if budgets[False] is None else math.floor(budgets[False] / 2**30 * 100) / 100,
            "resident_share": share,
            "expected_decode": None if share is None else expected_decode(share, measured, len(per_layer))}  # fmt: skip


def node_bytes(rows: list[int], dim: int, tp: int, dp: int, across: bool, gpus_per_node: int) -> dict:
    """INT8 host bytes on one node holding `gpus_per_node` ranks (a whole number of TP groups when it can)."""
    table = sum(rows) * (dim + 2)
    ranks = min(tp * dp, gpus_per_node)
    if across:  # rows split over every rank: each holds its own slice, nothing to share
        private = shared = table * ranks / (tp * dp)
    else:  # each DP replica's TP ranks split the whole table; sharing keeps one copy of each TP slice
        private = table * ranks / tp
        shared = table * min(ranks, tp) / tp
    return {"host_bytes_per_node_int8": round(private), "host_bytes_per_node_int8_dp_shared": round(shared)}


GIB = 2**30


def print_layouts(rows: list[dict]) -> None:
    print(f"{'TP':>2} {'DP':>2} {'xDP':>3} | {'BF16 GiB':>9} {'INT8 GiB':>9} | {'node host GiB':>13} {'shared':>7} | "
          f"{'GPU scales':>10} | {'PCIe MiB/step':>13} {'ETP MiB/step':>12} {'upstream':>9}")  # fmt: skip
    for r in rows:
        if r["tp"] in (1, 2, 4, 8) and r["dp"] in (1, 2, 4, 8):
            print(f"{r['tp']:>2} {r['dp']:>2} {'y' if r['embedding_across_dp'] else 'n':>3} | "
                  f"{r['bf16_table_bytes_per_rank'] / GIB:9.2f} {r['int8_table_bytes_per_rank'] / GIB:9.2f} | "
                  f"{r['host_bytes_per_node_int8'] / GIB:13.2f} {r['host_bytes_per_node_int8_dp_shared'] / GIB:7.2f} | "
                  f"{r['gpu_bytes_per_rank_host_int8_device_scales'] / GIB:10.3f} | "
                  f"{r['pcie_bytes_per_step_int8'] / 2**20:13.2f} {r['etp_bytes_per_step'] / 2**20:12.2f} "
                  f"{r['etp_bytes_per_step_upstream'] / 2**20:9.2f}")


def print_file_tier(rows: list[dict], host_table_gib: float) -> None:
    print(f"\nfile tier, host_table_gib={host_table_gib}: per rank GiB")
    print(f"{'TP':>2} {'DP':>2} {'xDP':>3} | {'pinned':>7} {'files':>7} {'maps':>5} {'GPU':>4}")
    for r in rows:
        if r["tp"] in (1, 2, 4, 8) and r["dp"] in (1, 2) and not r["embedding_across_dp"]:
            print(f"{r['tp']:>2} {r['dp']:>2} {'n':>3} | {r['file_tier_pinned_bytes_per_rank'] / GIB:7.2f} "
                  f"{r['file_tier_file_bytes_per_rank'] / GIB:7.2f} {r['file_tier_host_map_bytes_per_rank'] / GIB:5.2f} "
                  f"{r['file_tier_gpu_bytes_per_rank'] / GIB:4.1f}")


def describe_measurement(m: dict) -> str:
    """One serving measurement in words: its decode against the whole table, where it comes from, and whether its
    budget bound."""
    ratios = " / ".join(f"{v:.3f}" for v in m["decode_vs_whole_table"].values()) if m["decode_vs_whole_table"] else "?"
    resident, slots = m["resident_slots"] or (None, None)
    bound = ("" if slots is None else f"; {resident:,} of {slots:,} slots resident"
             + (": the budget bound" if resident == slots else ": the budget did not bind"))  # fmt: skip
    rows = f", a table of {m['table_rows']:,} rows" if m["table_rows"] else ""
    return (f"{m['share']:.0%} resident{' (calibrated)' if m['calibrated'] else ''}, {m['prompts']} prompts"
            f"{', misses read from the drive' if m.get('cold_reads') else ''}: decode b = {' / '.join(m['decode_tokens_per_s'])}: "
            f"{ratios}x the whole table pinned ({m['gpu']}, {m['graph_mode']}{rows}; {m['file']}"
            + (f" and {m['whole_table_file']}" if m["whole_table_file"] not in (None, m["file"]) else "") + f"){bound}")


def print_host_ram(rows: list[dict], host_ram_gib: float, reserve_gib: float, gpus_per_node: int) -> None:
    print(f"\nhost RAM {host_ram_gib:g} GiB a node, {reserve_gib:g} GiB of it kept for the OS and the engine processes "
          "(--host-reserve-gib; nothing else here counts them):")  # fmt: skip
    for r in rows:  # one replica, and replicas filling the node (rows not split over DP)
        if r["tp"] not in (1, 2, 4, 8) or r["dp"] not in {1, max(1, gpus_per_node // r["tp"])} or r["embedding_across_dp"]:
            continue
        a, n = r["host_ram"], r["host_ram"]["ranks_on_node"]
        head = f"TP{r['tp']} DP{r['dp']}: {n} rank{'s' if n > 1 else ''} on the node, {a['host_ram_bytes_per_rank'] / GIB:.2f} GiB each"
        if a["whole_table_fits"]:
            print(f"{head}: the whole table fits pinned ({r['int8_table_bytes_per_rank'] / GIB:.2f} GiB a rank): no host_table_gib")
            continue
        if a["whole_table_fits_dp_shared"]:
            print(f"{head}: the whole table fits pinned once a node with dp_shared_memory")
            head = "    without it"
        if a["host_table_gib"] is None:
            print(f"{head}: not even the file tier's staging and row maps fit")
            continue
        print(f"{head}: host_table_gib {a['host_table_gib']} ({a['host_table_gib_calibrated']} with host_table_calibration), "
              f"{a['resident_share']:.1%} of the rank's {r['int8_table_bytes_per_rank'] / GIB:.2f} GiB table resident")
        expected = a["expected_decode"]
        if not expected["measured"]:
            print(f"    {expected['note']}" + ("; the nearest below:" if expected["nearest_below"] else ""))
        for m in expected["measured"] or expected["nearest_below"]:
            print(f"    {describe_measurement(m)}")
        if drive := expected["drive_bound"]:
            print(f"    with every miss read from the drive (cold lookups at {drive['share_measured']:.0%} resident on the "
                  f"{drive['device']} machine's drive, added to the pinned table's H200 decode steps): "
                  + "; ".join(f"{stream} ({v['resident_hits']:.0%} of rows resident, {v['pages_per_token']:.1f} pages a "
                              f"token at {v['pages_per_s'] / 1e3:.0f} k pages/s) b = {' / '.join(v['decode_vs_whole_table'])}: "
                              + " / ".join(f"{x:.2f}" for x in v["decode_vs_whole_table"].values()) + "x"
                              for stream, v in drive["streams"].items()))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    ap.add_argument("--num-ple-layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per DP rank per step")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--hot-rows-gib", type=float, default=0.0, help="GPU hot-row cache per rank (serving's hot_rows_gib)")
    ap.add_argument("--host-table-gib", type=float, default=0.0, help="resident PLE rows per rank, the rest in files (serving's host_table_gib)")
    ap.add_argument("--host-ram-gib", type=float, default=0.0, help="a node's host RAM: the host_table_gib to set for it")
    ap.add_argument("--host-reserve-gib", type=float, default=0.0, help="of --host-ram-gib, what the OS and the engine processes keep")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="vLLM's step limit (sizes the file tier's staging)")
    ap.add_argument("--out", default="benchmarks/results/plan_memory.json")
    args = ap.parse_args()
    cfg = load_config(args.config, args.num_ple_layers)
    host_ram = (args.host_ram_gib - args.host_reserve_gib) * GIB if args.host_ram_gib else 0
    measured = measured_decode() if host_ram else []
    rows = plan(cfg, args.tokens, args.gpus_per_node, int(args.hot_rows_gib * GIB), int(args.host_table_gib * GIB),
                args.max_num_batched_tokens, host_ram, measured)  # fmt: skip
    print_layouts(rows)
    if args.host_table_gib:
        print_file_tier(rows, args.host_table_gib)
    if host_ram:
        print_host_ram(rows, args.host_ram_gib, args.host_reserve_gib, args.gpus_per_node)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"ple_layer_ids": list(cfg.ple_layer_ids), "tokens_per_dp_rank": args.tokens, "gpus_per_node": args.gpus_per_node,
            "hot_rows_bytes_per_rank": int(args.hot_rows_gib * GIB), "host_table_bytes_per_rank": int(args.host_table_gib * GIB),
            "max_num_batched_tokens": args.max_num_batched_tokens,
            **({"host_ram_bytes": args.host_ram_gib * GIB, "host_reserve_bytes": args.host_reserve_gib * GIB} if host_ram else {})}  # fmt: skip
    Path(args.out).write_text(json.dumps({**meta, "plans": rows}, indent=1))


if __name__ == "__main__":
    main()
