"""Offloaded INT8 PLE lookup bandwidth on one GPU, every path side by side in one run.

    python benchmarks/bench_lookup.py [--table-gb 12] [--tokens 16384] [--one-host-copy [--huge-pages]]
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
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from qwen4_exp_hcu.kernels.gather_dequant import INT8, _to_bf16_rtne
from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant as gather_rows
from qwen4_exp_hcu.kernels.ngram_hash import ngram_hash
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows
from qwen4_exp_hcu.ple.formats.int8 import quantize_rows
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

REAL_VOCAB = 248_320
gather_dequant = functools.partial(gather_rows, kind=INT8)  # every table here: INT8 rows + bf16 row scales


def bench_config(rows_target: int, heads_per_ngram: int, dim: int) -> SimpleNamespace:
    """A PLE config with the real hash (N=3, vocab 248 320, hc 4, hidden 2048) whose per-head prime
    sizes give the table ~rows_target rows."""
    heads = 2 * heads_per_ngram
    return SimpleNamespace(
        vocab_size=REAL_VOCAB, hidden_size=heads * dim, ple_embed_dim=heads * dim, ngram_size=3,
        heads_per_ngram=heads_per_ngram, ngram_vocab_size_base=rows_target // heads,
        make_ngram_vocab_size_divisible_by=128, seed=1234, ple_layer_ids=[1], layer_types=["linear_attention"],
        num_hidden_layers=1, eos_token_id=REAL_VOCAB - 1, hc_count=4, ple_conv_kernel_size=4,
        split_ngram_parts=512, rms_norm_eps=1e-6,
    )


def token_streams(n: int, gen: torch.Generator, offset: int = 0) -> dict[str, torch.Tensor]:
    ranks = torch.arange(1, REAL_VOCAB + 1, dtype=torch.float64)
    zipf = torch.randperm(REAL_VOCAB, generator=gen)[torch.multinomial(ranks.pow(-1.1), n, True, generator=gen)]
    streams = {"uniform": torch.randint(0, REAL_VOCAB, (n,), generator=gen), "zipf1.1": zipf}
    text = Path(__file__).parent / "data" / "text_tokens.safetensors"
    if text.exists():
        from safetensors.torch import load_file

        toks = load_file(text)["tokens"].long()
        streams["text"] = toks.roll(-offset).repeat(-(-n // toks.numel()))[:n]  # calibration: the text after
    return streams


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
    """A CUDA tensor aliasing a pinned host tensor (what the earlier implementation fed F.embedding)."""
    import cupy

    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    mem = cupy.cuda.UnownedMemory(raw.data_ptr(), raw.nbytes, raw)
    arr = cupy.ndarray(tuple(raw.shape), dtype=str(raw.dtype).removeprefix("torch."), memptr=cupy.cuda.MemoryPointer(mem, 0))
    view = torch.as_tensor(arr, device="cuda")
    return view.view(torch.bfloat16) if t.dtype == torch.bfloat16 else view


def main() -> None:
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
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    D, T = args.dim, args.tokens
    spec = NgramHashSpec.from_config(bench_config(int(args.table_gb * 1e9) // (D + 2), args.heads_per_ngram, D), 0)
    R, H = spec.rows, spec.num_heads
    t0 = time.time()
    numa_before = numa_nodes()
    table = PLETable(R, D, PLEStorage("int8", "cuda", host=True, huge_pages=args.huge_pages))
    w_host, s_host = table.weight, table.scale
    chunk = 1 << 24
    pattern = torch.randint(-127, 128, (chunk, D), dtype=torch.int8, generator=gen)
    for a in range(0, R, chunk):
        w_host[a : a + chunk].copy_(pattern[: min(chunk, R - a)])
    s_host.copy_((torch.rand(R, 1, generator=gen) * 0.02).to(torch.bfloat16))
    table_bytes = w_host.nbytes + s_host.nbytes
    print(f"table {R} rows x {D} B = {table_bytes / 1e9:.2f} GB pinned in {time.time() - t0:.0f}s: {table.describe()}", flush=True)
    numa = {"gpu_node": gpu_numa_node(), "table_GB_by_node": {n: round((numa_before[n] - free) / 1e9, 2)
                                                              for n, free in numa_nodes().items()}}  # fmt: skip
    print(f"NUMA: {numa}", flush=True)

    bulk = torch.empty(1 << 31, dtype=torch.int8, pin_memory=True)
    bulk_gpu = torch.empty_like(bulk, device="cuda")
    bulk_gbs = bulk.nbytes / do_bench(lambda: bulk_gpu.copy_(bulk, non_blocking=True)) / 1e6
    del bulk, bulk_gpu
    w_gpu, s_gpu = w_host.cuda(), s_host.cuda()
    w_uva, s_uva = uva_view(w_host), uva_view(s_host)
    useful = T * H * (D + 2)

    qsl = torch.arange(0, T + 1, 1024, device="cuda", dtype=torch.int32)
    ctx = torch.full((qsl.numel() - 1, 2), spec.eos_token_id, device="cuda", dtype=torch.int64)
    out = torch.empty(T, H * D, dtype=torch.bfloat16, device="cuda")
    stage_w = torch.empty(T * H, D, dtype=torch.int8, pin_memory=True)
    stage_s = torch.empty(T * H, 1, dtype=torch.bfloat16, pin_memory=True)

    # tuning sweeps of the fused kernel (uniform ids), ids as they come and sorted
    ids_uniform = torch.randint(0, R, (T, H), device="cuda")
    sweeps = {False: {}, True: {}}
    for sort in (False, True):
        for bp in (1, 2, 4, 8, 16, 32, 64, 128):  # 1 and 2: the 52 GB TP1 table read best at the smallest tried (4)
            for nw in (1, 2, 4, 8, 16):
                fn = lambda: gather_dequant(ids_uniform, w_host, s_host, 0, out, block_p=bp, num_warps=nw, sort=sort)
                sweeps[sort][f"block_p={bp},warps={nw}"] = useful / do_bench(fn) / 1e6
    best = {sort: max(sw, key=sw.get) for sort, sw in sweeps.items()}
    tuned = {sort: dict(zip(("block_p", "num_warps"), (int(kv.split("=")[1]) for kv in b.split(",")))) for sort, b in best.items()}
    print(f"best fused config {best[False]}: {sweeps[False][best[False]]:.2f} GB/s; "
          f"sorted {best[True]}: {sweeps[True][best[True]]:.2f} GB/s", flush=True)

    huge = packed = None
    if not args.one_host_copy:
        # the same rows on 2 MiB pages (--engram-config.use_thp): hugetlb when reserved, else THP
        huge = PLETable(R, D, PLEStorage("int8", "cuda", host=True, huge_pages=True))
        for a in range(0, R, chunk):
            huge.weight[a : a + chunk].copy_(w_host[a : a + chunk])
        huge.scale.copy_(s_host)
        print(f"2 MiB-page copy: {huge.describe()}", flush=True)
        try:
            packed = torch.empty(R, D + 2, dtype=torch.int8, pin_memory=True)
            for a in range(0, R, chunk):
                b = min(a + chunk, R)
                packed[a:b, :D].copy_(w_host[a:b])
                packed[a:b, D:].copy_(s_host[a:b].view(torch.int8).view(b - a, 2))
        except RuntimeError as e:  # host memory
            print("packed variant skipped:", e)
            packed = None

    def earlier(ids):
        e = F.embedding(ids, w_uva).float() * F.embedding(ids, s_uva).float()
        out.copy_(e.to(torch.bfloat16).view(T, H * D))

    def vllm_style(ids):
        flat = ids.view(-1)
        rows, sc = w_uva.index_select(0, flat), s_uva.index_select(0, flat)
        out.copy_((rows.float() * sc.float()).to(torch.bfloat16).view(T, H * D))

    unique_rows = torch.empty(T * H, D, dtype=torch.bfloat16, device="cuda")
    no_sort = {k: v for k, v in PLETable.HOST_TUNING.items() if k != "sort"}

    def dedup(ids):
        """Each distinct row read once (torch.unique sorts), then expanded; unique's size is a host sync."""
        rows, inverse = torch.unique(ids.view(-1), return_inverse=True)
        got = gather_dequant(rows.view(-1, 1), w_host, s_host, 0, unique_rows[: rows.numel()], **no_sort)
        out.copy_(got[inverse].view(T, H * D))

    def host_staging(ids):
        flat = ids.view(-1).cpu()
        torch.index_select(w_host, 0, flat, out=stage_w)
        torch.index_select(s_host, 0, flat, out=stage_s)
        rows, sc = stage_w.cuda(non_blocking=True), stage_s.cuda(non_blocking=True)
        out.copy_((rows.float() * sc.float()).to(torch.bfloat16).view(T, H * D))

    variants = {
        "fused, ids as they come (ours)": lambda ids: gather_dequant(ids, w_host, s_host, 0, out, **tuned[False]),
        "fused, sorted ids (ours, default)": lambda ids: gather_dequant(ids, w_host, s_host, 0, out, **PLETable.HOST_TUNING),
        "fused, sorted + dedup (ours; host sync)": dedup,
        "fused, sorted + GPU hot-row cache (ours)": lambda ids: gather_dequant(
            ids, w_host, s_host, 0, out, cache=hot.tensors, **PLETable.HOST_TUNING
        ),
        "fused, sorted + hot rows from traffic (serving: counted every lookup)": lambda ids: (
            traffic.observe(ids), gather_dequant(ids, w_host, s_host, 0, out, cache=traffic.tensors, **PLETable.HOST_TUNING)
        ),
        "earlier impl (F.embedding on UVA)": earlier,
        "vLLM-style (row copy, then dequant)": vllm_style,
        "host gather + H2D": host_staging,
        "GPU-resident (ours)": lambda ids: gather_dequant(ids, w_gpu, s_gpu, 0, out, **PLETable.DEVICE_TUNING),
        "fused, sorted, scales on the GPU": lambda ids: gather_dequant(ids, w_host, s_gpu, 0, out, **PLETable.HOST_TUNING),
    }
    if huge is not None:
        variants[f"fused, sorted, {huge.pages} 2 MiB pages"] = lambda ids: gather_dequant(
            ids, huge.weight, huge.scale, 0, out, **PLETable.HOST_TUNING
        )
        variants[f"fused, sorted, {huge.pages} 2 MiB pages + scales on the GPU"] = lambda ids: gather_dequant(
            ids, huge.weight, s_gpu, 0, out, **PLETable.HOST_TUNING
        )
    if packed is not None:
        bp, nw = tuned[False]["block_p"], tuned[False]["num_warps"]
        variants["fused, scale beside row"] = lambda ids: _packed_kernel[(triton.cdiv(T * H, bp),)](
            ids, packed, out, T * H, D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_P=bp, num_warps=nw
        )

    results = {}
    hot = HotRows(w_host, s_host, 0, args.cache_rows, "cuda", observe=False)
    traffic = HotRows(w_host, s_host, 0, args.cache_rows, "cuda", observe=True)
    calib_streams = token_streams(args.calib_tokens, torch.Generator().manual_seed(1), offset=T)
    for source, tokens in token_streams(T, gen).items():
        tok = tokens.cuda()
        ids = ids_uniform if source == "uniform" else ngram_hash(spec, tok, qsl, ctx)
        # hot-row cache from a separate calibration stream of the same kind (never the measured tokens)
        calib = calib_streams[source].cuda()
        cq = torch.arange(0, calib.numel() + 1, 1024, device="cuda", dtype=torch.int32)
        cctx = torch.full((cq.numel() - 1, 2), spec.eos_token_id, device="cuda", dtype=torch.int64)
        calib_ids = torch.randint(0, R, (calib.numel(), H), device="cuda") if source == "uniform" else ngram_hash(spec, calib, cq, cctx)
        hot.fill(calib_ids)
        traffic.counts.zero_()
        traffic.observe(calib_ids)  # served traffic so far: the calibration stream, refreshed into the cache
        traffic.refresh(traffic.counts[:-1])
        hit_rate = float((hot.map[ids.flatten()] >= 0).float().mean())
        ref = gather_dequant(ids, w_gpu, s_gpu, 0, torch.empty_like(out)).clone()
        hash_ms = do_bench(lambda: ngram_hash(spec, tok, qsl, ctx))
        unique = torch.unique(ids).numel() / ids.numel()
        results[source] = {"unique_row_fraction": unique, "hash_ms": hash_ms, "cache_hit_rate": hit_rate, "variants": {}}
        for name, fn in variants.items():
            fn(ids)
            torch.cuda.synchronize()
            exact = bool(torch.equal(out, ref))
            ms = do_bench(lambda: fn(ids))
            gbs = useful / ms / 1e6
            results[source]["variants"][name] = {"ms": ms, "GB/s": gbs, "ratio_to_bulk": gbs / bulk_gbs, "exact": exact}
            print(f"{source:8s} {name:38s} {ms:8.3f} ms {gbs:7.2f} GB/s  x{gbs / bulk_gbs:.3f} bulk  exact={exact}", flush=True)
        fused = results[source]["variants"]["fused, sorted ids (ours, default)"]["ms"]
        results[source]["hash_over_lookup"] = hash_ms / fused

    formats = {}
    if args.formats_table_gb > 0:
        del packed, huge, w_gpu, s_gpu, table, w_host, s_host, hot, traffic  # make room for the format tables
        formats = bench_formats(args, token_streams(T, torch.Generator().manual_seed(0)), "cuda", do_bench)

    report = {
        "formats": formats,
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "cpu_count": __import__("os").cpu_count(),
                    "numa": numa},
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "params": {"table_bytes": table_bytes, "rows": R, "dim": D, "heads": H, "tokens": T, "useful_bytes": useful,
                   "table": table.describe()},
        "bulk_pinned_to_gpu_GBps": bulk_gbs,
        "fused_sweep_uniform_GBps": sweeps[False],
        "fused_sorted_sweep_uniform_GBps": sweeps[True],
        "best_config": {"unsorted": tuned[False], "sorted": tuned[True]},
        "library_host_tuning": PLETable.HOST_TUNING,
        "cache_rows": args.cache_rows,
        "results": results,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_lookup.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "bench_lookup.png")
    print(json.dumps({s: {k: round(v["GB/s"], 2) for k, v in r["variants"].items()} for s, r in results.items()}, indent=1))


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
