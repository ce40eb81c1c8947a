"""Per-rank PLE memory and per-step traffic for a config and a TP x DP layout (no GPU needed).

    python -m benchmarks.plan_memory [--config CKPT_OR_CONFIG_JSON] [--num-ple-layers 1] [--tokens 256]
                                     [--gpus-per-node 8] [--hot-rows-gib 0] [--host-table-gib 0]

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
Writes benchmarks/results/plan_memory.json.
"""

from __future__ import annotations

import argparse
import json
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
         max_step_tokens: int = 8192) -> list[dict]:
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
                out.append(row)
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    ap.add_argument("--num-ple-layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per DP rank per step")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--hot-rows-gib", type=float, default=0.0, help="GPU hot-row cache per rank (serving's hot_rows_gib)")
    ap.add_argument("--host-table-gib", type=float, default=0.0, help="resident PLE rows per rank, the rest in files (serving's host_table_gib)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="vLLM's step limit (sizes the file tier's staging)")
    ap.add_argument("--out", default="benchmarks/results/plan_memory.json")
    args = ap.parse_args()
    cfg = load_config(args.config, args.num_ple_layers)
    rows = plan(cfg, args.tokens, args.gpus_per_node, int(args.hot_rows_gib * 2**30), int(args.host_table_gib * 2**30),
                args.max_num_batched_tokens)
    gib = 2**30
    print(f"{'TP':>2} {'DP':>2} {'xDP':>3} | {'BF16 GiB':>9} {'INT8 GiB':>9} | {'node host GiB':>13} {'shared':>7} | "
          f"{'GPU scales':>10} | {'PCIe MiB/step':>13} {'ETP MiB/step':>12} {'upstream':>9}")  # fmt: skip
    for r in rows:
        if r["tp"] in (1, 2, 4, 8) and r["dp"] in (1, 2, 4, 8):
            print(f"{r['tp']:>2} {r['dp']:>2} {'y' if r['embedding_across_dp'] else 'n':>3} | "
                  f"{r['bf16_table_bytes_per_rank'] / gib:9.2f} {r['int8_table_bytes_per_rank'] / gib:9.2f} | "
                  f"{r['host_bytes_per_node_int8'] / gib:13.2f} {r['host_bytes_per_node_int8_dp_shared'] / gib:7.2f} | "
                  f"{r['gpu_bytes_per_rank_host_int8_device_scales'] / gib:10.3f} | "
                  f"{r['pcie_bytes_per_step_int8'] / 2**20:13.2f} {r['etp_bytes_per_step'] / 2**20:12.2f} "
                  f"{r['etp_bytes_per_step_upstream'] / 2**20:9.2f}")
    if args.host_table_gib:
        print(f"\nfile tier, host_table_gib={args.host_table_gib}: per rank GiB")
        print(f"{'TP':>2} {'DP':>2} {'xDP':>3} | {'pinned':>7} {'files':>7} {'maps':>5} {'GPU':>4}")
        for r in rows:
            if r["tp"] in (1, 2, 4, 8) and r["dp"] in (1, 2) and not r["embedding_across_dp"]:
                print(f"{r['tp']:>2} {r['dp']:>2} {'n':>3} | {r['file_tier_pinned_bytes_per_rank'] / gib:7.2f} "
                      f"{r['file_tier_file_bytes_per_rank'] / gib:7.2f} {r['file_tier_host_map_bytes_per_rank'] / gib:5.2f} "
                      f"{r['file_tier_gpu_bytes_per_rank'] / gib:4.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"ple_layer_ids": list(cfg.ple_layer_ids), "tokens_per_dp_rank": args.tokens, "gpus_per_node": args.gpus_per_node,
            "hot_rows_bytes_per_rank": int(args.hot_rows_gib * 2**30), "host_table_bytes_per_rank": int(args.host_table_gib * 2**30),
            "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    Path(args.out).write_text(json.dumps({**meta, "plans": rows}, indent=1))


if __name__ == "__main__":
    main()
