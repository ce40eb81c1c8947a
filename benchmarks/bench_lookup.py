"""Offloaded INT8 PLE lookup bandwidth on one GPU, every path side by side in one run.

    python -m benchmarks.bench_lookup [--table-gb 12] [--tokens 16384] [--one-host-copy [--huge-pages]]
                                       [--out benchmarks/results]

Table: INT8 rows of `--dim` bytes + one bf16 scale per row, sized to `--table-gb`, in pinned host memory
(and a GPU-resident copy for the reference path). Row ids come from our n-gram hash (16 heads) over
token streams: uniform ids, Zipf(1.1) tokens over the real vocab (248 320), and natural text
(benchmarks/data/text_tokens.safetensors). Reported: GB/s of useful bytes (row + scale per (token, head))
and the ratio to the measured bulk pinned->GPU copy bandwidth. Writes JSON + PNG into `--out`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from benchmarks.common import bench_config, commit, save, token_streams
from qwen4_exp_hcu.kernels.gather_dequant import INT8, _to_bf16_rtne
from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant as gather_rows
from qwen4_exp_hcu.kernels.ngram_hash import ngram_hash
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows
from qwen4_exp_hcu.ple.formats.int8 import quantize_rows
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

CHUNK = 1 << 24  # rows copied at a time into a pinned table
DEFAULT = "fused, sorted ids (ours, default)"
gather_dequant = functools.partial(gather_rows, kind=INT8)  # every table here: INT8 rows + bf16 row scales


@triton.jit
def _packed_kernel(ids_ptr, rows_ptr, out_ptr, n_pairs, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    """Variant: scale stored beside its row ([rows, D + 2] bytes), one contiguous read per row."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    m = p < n_pairs
    row = tl.load(ids_ptr + p, mask=m, other=0)
    cols = tl.arange(0, BLOCK_D)
    mc = m[:, None] & (cols[None, :] < D)
    base = rows_ptr + row * (D + 2)
    w = tl.load(base[:, None] + cols[None, :], mask=mc, other=0).to(tl.float32)
    lo = tl.load(base + D, mask=m, other=0).to(tl.uint8).to(tl.uint16)
    hi = tl.load(base + D + 1, mask=m, other=0).to(tl.uint8).to(tl.uint16)
    scale = (lo | (hi << 8)).to(tl.bfloat16, bitcast=True).to(tl.float32)
    tl.store(out_ptr + p[:, None] * D + cols[None, :], _to_bf16_rtne(w * scale[:, None]), mask=mc)


def numa_nodes() -> dict[str, int]:
    """Free bytes per host NUMA node: taken before and after the table is pinned, where its pages went (a GPU reads
    another node's memory over the link between sockets)."""
    free = {}
    for meminfo in sorted(Path("/sys/devices/system/node").glob("node*/meminfo")):
        kb = next(line.split()[-2] for line in meminfo.read_text().splitlines() if "MemFree:" in line)
        free[meminfo.parent.name] = int(kb) * 1024
    return free


def gpu_numa_node() -> int | None:
    """The host NUMA node the GPU's PCI device sits on (-1: the firmware does not say; None: not found)."""
    p = torch.cuda.get_device_properties(0)
    path = Path(f"/sys/bus/pci/devices/{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0/numa_node")
    return int(path.read_text()) if path.exists() else None


def uva_view(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor aliasing a pinned host tensor (what the `earlier` variant feeds F.embedding)."""
    import cupy

    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    mem = cupy.cuda.UnownedMemory(raw.data_ptr(), raw.nbytes, raw)
    arr = cupy.ndarray(tuple(raw.shape), dtype=str(raw.dtype).removeprefix("torch."), memptr=cupy.cuda.MemoryPointer(mem, 0))
    view = torch.as_tensor(arr, device="cuda")
    return view.view(torch.bfloat16) if t.dtype == torch.bfloat16 else view


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=12.0)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads-per-ngram", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--calib-tokens", type=int, default=131072)
    ap.add_argument("--cache-rows", type=int, default=1 << 23, help="GPU hot-row cache size (8M rows ~ 1 GB)")
    ap.add_argument("--formats-table-gb", type=float, default=4.0,
                    help="INT8 size of the table each row format is measured on (0: skip the format rows)")
    ap.add_argument("--one-host-copy", action="store_true",
                    help="skip the variants that pin a second and a third copy of the table (2 MiB pages, scale beside "
                    "row): the release's whole 52 GB TP1 table then fits a 128 GiB host")
    ap.add_argument("--huge-pages", action="store_true",
                    help="the table itself on 2 MiB pages (with --one-host-copy, where no second copy is)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.huge_pages and not args.one_host_copy:
        ap.error("--huge-pages puts the one host copy on 2 MiB pages: the default run measures them on a second copy")
    return args


@dataclass
class Setup:
    """The table in pinned host memory (and its GPU copy and UVA views for the reference paths), the output buffer,
    and the measured tokens' requests: what every lookup variant reads."""

    spec: NgramHashSpec
    T: int
    table: PLETable
    w_gpu: torch.Tensor
    s_gpu: torch.Tensor
    w_uva: torch.Tensor
    s_uva: torch.Tensor
    out: torch.Tensor
    qsl: torch.Tensor  # the measured tokens' requests (`layout`)
    ctx: torch.Tensor

    @property
    def w_host(self) -> torch.Tensor:
        return self.table.weight

    @property
    def s_host(self) -> torch.Tensor:
        return self.table.scale

    @property
    def useful(self) -> int:
        """Bytes a lookup reads for its result: a row and its scale per token and head."""
        return self.T * self.spec.num_heads * (self.spec.head_dim + 2)

    def row_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row ids `[T, heads]` of the `T` measured tokens."""
        return ngram_hash(self.spec, tokens, self.qsl, self.ctx)


def layout(spec: NgramHashSpec, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`query_start_loc` of `tokens` in requests of 1024, and each request's fresh n-gram context."""
    qsl = torch.arange(0, tokens + 1, 1024, device="cuda", dtype=torch.int32)
    return qsl, torch.full((qsl.numel() - 1, 2), spec.eos_token_id, device="cuda", dtype=torch.int64)


def pinned_table(args: argparse.Namespace, spec: NgramHashSpec, gen: torch.Generator) -> tuple[PLETable, dict]:
    """The INT8 table of random rows pinned in host memory, and where its pages went (NUMA)."""
    t0 = time.time()
    numa_before = numa_nodes()
    table = PLETable(spec.rows, spec.head_dim, PLEStorage("int8", "cuda", host=True, huge_pages=args.huge_pages))
    pattern = torch.randint(-127, 128, (CHUNK, spec.head_dim), dtype=torch.int8, generator=gen)
    for a in range(0, spec.rows, CHUNK):
        table.weight[a : a + CHUNK].copy_(pattern[: min(CHUNK, spec.rows - a)])
    table.scale.copy_((torch.rand(spec.rows, 1, generator=gen) * 0.02).to(torch.bfloat16))
    print(f"table {spec.rows} rows x {spec.head_dim} B = {table.nbytes / 1e9:.2f} GB pinned in {time.time() - t0:.0f}s: "
          f"{table.describe()}", flush=True)  # fmt: skip
    numa = {"gpu_node": gpu_numa_node(), "table_GB_by_node": {n: round((numa_before[n] - free) / 1e9, 2)
                                                              for n, free in numa_nodes().items()}}  # fmt: skip
    print(f"NUMA: {numa}", flush=True)
    return table, numa


def bulk_copy_gbs() -> float:
    """GB/s of one 2 GiB pinned host -> GPU copy: the bound a lookup's useful bytes are compared with."""
    bulk = torch.empty(1 << 31, dtype=torch.int8, pin_memory=True)
    bulk_gpu = torch.empty_like(bulk, device="cuda")
    return bulk.nbytes / do_bench(lambda: bulk_gpu.copy_(bulk, non_blocking=True)) / 1e6


def tuning_sweeps(s: Setup, ids: torch.Tensor) -> tuple[dict, dict]:
    """GB/s of the fused kernel per launch config on `ids`, as they come (False) and sorted (True); and each one's
    best config."""
    sweeps = {False: {}, True: {}}
    for sort in (False, True):
        for bp in (1, 2, 4, 8, 16, 32, 64, 128):  # 1 and 2: the 52 GB TP1 table reads best at 4, so below it too
            for nw in (1, 2, 4, 8, 16):
                fn = lambda: gather_dequant(ids, s.w_host, s.s_host, 0, s.out, block_p=bp, num_warps=nw, sort=sort)  # noqa: E731
                sweeps[sort][f"block_p={bp},warps={nw}"] = s.useful / do_bench(fn) / 1e6
    best = {sort: max(sw, key=sw.get) for sort, sw in sweeps.items()}
    tuned = {sort: dict(zip(("block_p", "num_warps"), (int(kv.split("=")[1]) for kv in b.split(",")))) for sort, b in best.items()}
    print(f"best fused config {best[False]}: {sweeps[False][best[False]]:.2f} GB/s; "
          f"sorted {best[True]}: {sweeps[True][best[True]]:.2f} GB/s", flush=True)
    return sweeps, tuned


def second_copies(s: Setup) -> tuple[PLETable, torch.Tensor | None]:
    """The same rows on 2 MiB pages (`--engram-config.use_thp`: hugetlb when reserved, else THP), and with each
    scale beside its row ([rows, D + 2] bytes; None where host memory runs out)."""
    R, D = s.spec.rows, s.spec.head_dim
    huge = PLETable(R, D, PLEStorage("int8", "cuda", host=True, huge_pages=True))
    for a in range(0, R, CHUNK):
        huge.weight[a : a + CHUNK].copy_(s.w_host[a : a + CHUNK])
    huge.scale.copy_(s.s_host)
    print(f"2 MiB-page copy: {huge.describe()}", flush=True)
    try:
        packed = torch.empty(R, D + 2, dtype=torch.int8, pin_memory=True)
        for a in range(0, R, CHUNK):
            b = min(a + CHUNK, R)
            packed[a:b, :D].copy_(s.w_host[a:b])
            packed[a:b, D:].copy_(s.s_host[a:b].view(torch.int8).view(b - a, 2))
    except RuntimeError as e:  # host memory
        print("packed variant skipped:", e)
        packed = None
    return huge, packed


def fused_variants(s: Setup, tuned: dict, hot: HotRows, traffic: HotRows) -> dict:
    """Our fused gather + dequant from the host table: tuned unsorted, the library's default, each row read once,
    and with a GPU hot-row cache filled from calibration or from the traffic."""
    T, HD = s.T, s.spec.num_heads * s.spec.head_dim
    unique_rows = torch.empty(T * s.spec.num_heads, s.spec.head_dim, dtype=torch.bfloat16, device="cuda")
    no_sort = {k: v for k, v in PLETable.HOST_TUNING.items() if k != "sort"}

    def dedup(ids):
        """Each distinct row read once (torch.unique sorts), then expanded; unique's size is a host sync."""
        rows, inverse = torch.unique(ids.view(-1), return_inverse=True)
        got = gather_dequant(rows.view(-1, 1), s.w_host, s.s_host, 0, unique_rows[: rows.numel()], **no_sort)
        s.out.copy_(got[inverse].view(T, HD))

    return {
        "fused, ids as they come (ours)": lambda ids: gather_dequant(ids, s.w_host, s.s_host, 0, s.out, **tuned[False]),
        DEFAULT: lambda ids: gather_dequant(ids, s.w_host, s.s_host, 0, s.out, **PLETable.HOST_TUNING),
        "fused, sorted + dedup (ours; host sync)": dedup,
        "fused, sorted + GPU hot-row cache (ours)": lambda ids: gather_dequant(
            ids, s.w_host, s.s_host, 0, s.out, cache=hot.tensors, **PLETable.HOST_TUNING
        ),
        "fused, sorted + hot rows from traffic (serving: counted every lookup)": lambda ids: (
            traffic.observe(ids), gather_dequant(ids, s.w_host, s.s_host, 0, s.out, cache=traffic.tensors, **PLETable.HOST_TUNING)
        ),
    }


def other_variants(s: Setup) -> dict:
    """The paths ours replaces: F.embedding over UVA views, vLLM's row copy then dequant, a host gather + copy."""
    T, H, D = s.T, s.spec.num_heads, s.spec.head_dim
    stage_w = torch.empty(T * H, D, dtype=torch.int8, pin_memory=True)
    stage_s = torch.empty(T * H, 1, dtype=torch.bfloat16, pin_memory=True)

    def earlier(ids):
        e = F.embedding(ids, s.w_uva).float() * F.embedding(ids, s.s_uva).float()
        s.out.copy_(e.to(torch.bfloat16).view(T, H * D))

    def vllm_style(ids):
        flat = ids.view(-1)
        rows, sc = s.w_uva.index_select(0, flat), s.s_uva.index_select(0, flat)
        s.out.copy_((rows.float() * sc.float()).to(torch.bfloat16).view(T, H * D))

    def host_staging(ids):
        flat = ids.view(-1).cpu()
        torch.index_select(s.w_host, 0, flat, out=stage_w)
        torch.index_select(s.s_host, 0, flat, out=stage_s)
        rows, sc = stage_w.cuda(non_blocking=True), stage_s.cuda(non_blocking=True)
        s.out.copy_((rows.float() * sc.float()).to(torch.bfloat16).view(T, H * D))

    return {"earlier impl (F.embedding on UVA)": earlier, "vLLM-style (row copy, then dequant)": vllm_style,
            "host gather + H2D": host_staging}  # fmt: skip


def placement_variants(s: Setup, tuned: dict, huge: PLETable | None, packed: torch.Tensor | None) -> dict:
    """The same lookup with the table elsewhere: in GPU memory, its scales there, on 2 MiB pages, scale beside row."""
    tuning = PLETable.HOST_TUNING
    variants = {
        "GPU-resident (ours)": lambda ids: gather_dequant(ids, s.w_gpu, s.s_gpu, 0, s.out, **PLETable.DEVICE_TUNING),
        "fused, sorted, scales on the GPU": lambda ids: gather_dequant(ids, s.w_host, s.s_gpu, 0, s.out, **tuning),
    }
    if huge is not None:
        variants[f"fused, sorted, {huge.pages} 2 MiB pages"] = lambda ids: gather_dequant(
            ids, huge.weight, huge.scale, 0, s.out, **tuning
        )
        variants[f"fused, sorted, {huge.pages} 2 MiB pages + scales on the GPU"] = lambda ids: gather_dequant(
            ids, huge.weight, s.s_gpu, 0, s.out, **tuning
        )
    if packed is not None:
        n, bp, nw = s.T * s.spec.num_heads, tuned[False]["block_p"], tuned[False]["num_warps"]
        variants["fused, scale beside row"] = lambda ids: _packed_kernel[(triton.cdiv(n, bp),)](
            ids, packed, s.out, n, D=s.spec.head_dim, BLOCK_D=triton.next_power_of_2(s.spec.head_dim), BLOCK_P=bp, num_warps=nw
        )
    return variants


def calibrate(s: Setup, source: str, calib: torch.Tensor, hot: HotRows, traffic: HotRows) -> None:
    """Both hot-row caches from a separate calibration stream of the same kind (never the measured tokens):
    `hot` filled from it, `traffic` refreshed from its counts (served traffic so far)."""
    calib = calib.cuda()
    if source == "uniform":
        calib_ids = torch.randint(0, s.spec.rows, (calib.numel(), s.spec.num_heads), device="cuda")
    else:
        calib_ids = ngram_hash(s.spec, calib, *layout(s.spec, calib.numel()))
    hot.fill(calib_ids)
    traffic.counts.zero_()
    traffic.observe(calib_ids)
    traffic.refresh(traffic.counts[:-1])


def measure_source(s: Setup, variants: dict, source: str, tokens: torch.Tensor, ids: torch.Tensor, hot: HotRows,
                   bulk_gbs: float) -> dict:  # fmt: skip
    """Every variant's lookup of `ids` (timed, and checked against the GPU-resident lookup), the hash of `tokens`
    timed against the default lookup, and the share of `ids` the calibrated hot-row cache serves."""
    hit_rate = float((hot.map[ids.flatten()] >= 0).float().mean())
    ref = gather_dequant(ids, s.w_gpu, s.s_gpu, 0, torch.empty_like(s.out)).clone()
    hash_ms = do_bench(lambda: s.row_ids(tokens))
    unique = torch.unique(ids).numel() / ids.numel()
    result = {"unique_row_fraction": unique, "hash_ms": hash_ms, "cache_hit_rate": hit_rate, "variants": {}}
    for name, fn in variants.items():
        fn(ids)
        torch.cuda.synchronize()
        exact = bool(torch.equal(s.out, ref))
        ms = do_bench(lambda: fn(ids))
        gbs = s.useful / ms / 1e6
        result["variants"][name] = {"ms": ms, "GB/s": gbs, "ratio_to_bulk": gbs / bulk_gbs, "exact": exact}
        print(f"{source:8s} {name:38s} {ms:8.3f} ms {gbs:7.2f} GB/s  x{gbs / bulk_gbs:.3f} bulk  exact={exact}", flush=True)
    result["hash_over_lookup"] = hash_ms / result["variants"][DEFAULT]["ms"]
    return result


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    spec = NgramHashSpec.from_config(bench_config(int(args.table_gb * 1e9) // (args.dim + 2), args.heads_per_ngram, args.dim), 0)
    table, numa = pinned_table(args, spec, gen)
    bulk_gbs = bulk_copy_gbs()
    out = torch.empty(args.tokens, spec.num_heads * spec.head_dim, dtype=torch.bfloat16, device="cuda")
    s = Setup(spec, args.tokens, table, table.weight.cuda(), table.scale.cuda(), uva_view(table.weight), uva_view(table.scale),
              out, *layout(spec, args.tokens))  # fmt: skip
    ids_uniform = torch.randint(0, spec.rows, (args.tokens, spec.num_heads), device="cuda")
    sweeps, tuned = tuning_sweeps(s, ids_uniform)
    huge, packed = (None, None) if args.one_host_copy else second_copies(s)
    hot = HotRows(s.w_host, s.s_host, 0, args.cache_rows, "cuda", observe=False)
    traffic = HotRows(s.w_host, s.s_host, 0, args.cache_rows, "cuda", observe=True)
    variants = {**fused_variants(s, tuned, hot, traffic), **other_variants(s), **placement_variants(s, tuned, huge, packed)}
    calib_streams = token_streams(args.calib_tokens, torch.Generator().manual_seed(1), offset=args.tokens)
    results = {}
    for source, tokens in token_streams(args.tokens, gen).items():
        tok = tokens.cuda()
        ids = ids_uniform if source == "uniform" else s.row_ids(tok)
        calibrate(s, source, calib_streams[source], hot, traffic)
        results[source] = measure_source(s, variants, source, tok, ids, hot, bulk_gbs)
    params = {"table_bytes": table.nbytes, "rows": spec.rows, "dim": spec.head_dim, "heads": spec.num_heads,
              "tokens": args.tokens, "useful_bytes": s.useful, "table": table.describe()}  # fmt: skip
    formats = {}
    if args.formats_table_gb > 0:
        del s, variants, table, huge, packed, hot, traffic  # make room for the format tables
        formats = bench_formats(args, token_streams(args.tokens, torch.Generator().manual_seed(0)), "cuda", do_bench)
    report = {
        "formats": formats,
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "cpu_count": os.cpu_count(), "numa": numa},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "params": params,
        "bulk_pinned_to_gpu_GBps": bulk_gbs,
        "fused_sweep_uniform_GBps": sweeps[False],
        "fused_sorted_sweep_uniform_GBps": sweeps[True],
        "best_config": {"unsorted": tuned[False], "sorted": tuned[True]},
        "library_host_tuning": PLETable.HOST_TUNING,
        "cache_rows": args.cache_rows,
        "results": results,
        "command": shlex.join(["python", "-m", "benchmarks.bench_lookup", *sys.argv[1:]]),
        "commit": commit(),
    }
    save(args.out, "bench_lookup", report, plot)
    print(json.dumps({src: {k: round(v["GB/s"], 2) for k, v in r["variants"].items()} for src, r in results.items()}, indent=1))


def random_table(fmt: str, rows: int, dim: int, device: str, gen: torch.Generator) -> PLETable:
    """A host-resident table of random finite values in `fmt`, filled in chunks (no full-size temporary)."""
    t = PLETable(rows, dim, PLEStorage(fmt, device, host=True))
    chunk = 1 << 22
    for a in range(0, rows, chunk):
        n = min(chunk, rows - a)
        if fmt in ("bf16", "int8"):
            w = torch.randn(n, dim, generator=gen).to(torch.bfloat16)
            if fmt == "int8":
                w, s = quantize_rows(w)
                t.scale[a : a + n].copy_(s)
            t.weight[a : a + n].copy_(w)
        else:
            b = torch.randint(0, 0x7E, t.weight[a : a + n].shape, generator=gen, dtype=torch.uint8)  # no NaN bytes
            t.weight[a : a + n].copy_(b.view(t.weight.dtype))
            if fmt == "nvfp4":
                t.scale[a : a + n].copy_(torch.randint(0x30, 0x48, t.scale[a : a + n].shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn))
    if t.tensor_scale is not None:  # through the loader's path: FP8 multiplies by the bf16-rounded scale
        t.set_table_scale(torch.tensor([0.01]), "table scale")
    return t


def bench_formats(args, streams: dict[str, torch.Tensor], device: str, timer) -> dict:
    """Every row format on a table of the same rows (INT8 size `--formats-table-gb`), host-resident:
    GB/s of useful bf16 output (T x H x D x 2 bytes per lookup), host bytes per row, and the lookup
    checked against the format's torch reference on a slice of the ids."""
    D, T = args.dim, args.tokens
    spec = NgramHashSpec.from_config(bench_config(int(args.formats_table_gb * 1e9) // (D + 2), args.heads_per_ngram, D), 0)
    R, H = spec.rows, spec.num_heads
    qsl = torch.arange(0, T + 1, 1024, device=device, dtype=torch.int32)
    ctx = torch.full((qsl.numel() - 1, 2), spec.eos_token_id, device=device, dtype=torch.int64)
    ids = {src: ngram_ids(spec, tok.to(device), qsl, ctx) for src, tok in streams.items()}
    out = torch.empty(T, H * D, dtype=torch.bfloat16, device=device)
    results = {"rows": R, "dim": D, "tokens": T, "heads": H, "formats": {}}
    gen = torch.Generator().manual_seed(2)
    for fmt in ("bf16", "int8", "fp8", "nvfp4"):
        table = random_table(fmt, R, D, device, gen)
        row = results["formats"][fmt] = {"host_bytes_per_row": table.nbytes / R, "GB/s": {}}
        for src, i in ids.items():
            head = i[:64].cpu()
            table.lookup(i, out=out)
            ref = PLETable.lookup(_on_cpu(table), head)
            row.setdefault("exact", []).append(bool(torch.equal(out[:64].cpu(), ref)))
            row["GB/s"][src] = T * H * D * 2 / timer(lambda: table.lookup(i, out=out)) / 1e6
        print(f"{fmt:6s} {row['host_bytes_per_row']:6.1f} B/row  "
              + "  ".join(f"{s} {g:6.2f} GB/s" for s, g in row["GB/s"].items()) + f"  exact={all(row['exact'])}", flush=True)
    return results


def _on_cpu(table: PLETable) -> PLETable:
    """The same table looked up by the torch reference (host tensors are read in place)."""
    view = PLETable.__new__(PLETable)
    view.__dict__.update(table.__dict__)
    view.tensor_scale = None if table.tensor_scale is None else table.tensor_scale.cpu()
    view.hot = None
    return view


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(report["results"])
    names = list(report["results"][sources[0]]["variants"])
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        vals = [report["results"][s]["variants"][name]["GB/s"] for s in sources]
        ax.bar([i + k * width for i in range(len(sources))], vals, width, label=name)
    ax.axhline(report["bulk_pinned_to_gpu_GBps"], color="k", ls="--", label="bulk pinned->GPU copy")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sources))], sources)
    ax.set_ylabel("useful GB/s (row + scale per token-head)")
    p = report["params"]
    ax.set_title(f"PLE INT8 lookup, {p['table_bytes'] / 1e9:.1f} GB table, {p['tokens']} tokens x {p['heads']} heads, {report['machine']['gpu']}")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
