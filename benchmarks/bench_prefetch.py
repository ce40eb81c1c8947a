"""Does the prefetch hide an offloaded PLE lookup? Step time of a decoder stack, three table set-ups.

    python benchmarks/bench_prefetch.py [--table-gb 12] [--layers 40] [--ple-layers 1,21] [--out benchmarks/results]

A stack of `--layers` decoder-layer stand-ins (hidden 2048, a dense up/down matmul pair of `--ffn` width:
~0.54 GB of bf16 weights per layer, less than a real Qwen4Exp MoE layer reads at decode, so hiding the
lookup here is the harder case) with a PLE lookup (n-gram hash + fused gather/dequant, 16 heads of 128 B
rows, then the key/value projection) at each PLE layer. Modes: table GPU-resident; host-offloaded with the
lookup started on a side stream before the preceding layer (PrefetchWorkspace's fork/join); host-offloaded
serial. Eager and CUDA-graph replay. Decode 64/256 tokens, prefill 4k/16k. Writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import triton

from benchmarks.bench_lookup import hash_spec
from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant
from qwen4_exp_hcu.kernels.ngram_hash import ngram_hash

HIDDEN = 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=12.0)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--ple-layers", default="1,21", help="0-indexed decoder layers carrying PLE")
    ap.add_argument("--ffn", type=int, default=65536)
    ap.add_argument("--tokens", default="64,256,4096,16384")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ple_layers = {int(x) for x in args.ple_layers.split(",")}
    spec = hash_spec(int(args.table_gb * 1e9) // 130, 8, 128)
    R, H, D = spec.rows, spec.num_heads, spec.head_dim
    w_host = torch.empty(R, D, dtype=torch.int8, pin_memory=True)
    s_host = torch.full((R, 1), 0.01, dtype=torch.bfloat16, pin_memory=True)
    w_gpu, s_gpu = w_host.cuda(), s_host.cuda()
    up = torch.randn(HIDDEN, args.ffn, device="cuda", dtype=torch.bfloat16) * 0.01
    down = torch.randn(args.ffn, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01
    kv = torch.randn(H * D, 5 * HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01  # key (hc=4) + value proj
    side = torch.cuda.Stream()
    results = {}

    for T in (int(t) for t in args.tokens.split(",")):
        tok = torch.randint(0, 248_320, (T,), device="cuda")
        qsl = torch.tensor([0, T], device="cuda", dtype=torch.int32)
        ctx = torch.full((1, 2), spec.eos_token_id, device="cuda", dtype=torch.int64)
        rows = torch.empty(T, H, dtype=torch.int64, device="cuda")
        emb = torch.empty(T, H * D, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
        done = torch.cuda.Event()

        def lookup(w, s):
            ngram_hash(spec, tok, qsl, ctx, out=rows)
            gather_dequant(rows, w, s, 0, emb, block_p=16, num_warps=4)

        def step(mode):
            h = x
            for li in range(args.layers):
                if mode == "host + prefetch" and li + 1 in ple_layers:  # start before the preceding layer
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        lookup(w_host, s_host)
                        done.record(side)
                if li in ple_layers:
                    if mode == "host + prefetch":
                        torch.cuda.current_stream().wait_event(done)
                    else:
                        lookup(*((w_gpu, s_gpu) if mode == "GPU-resident" else (w_host, s_host)))
                    h = h + (emb @ kv)[:, :HIDDEN]
                h = torch.relu(h @ up) @ down
            return h

        results[T] = {}
        for mode in ("GPU-resident", "host + prefetch", "host serial"):
            if 0 in ple_layers and mode == "host + prefetch":
                raise SystemExit("layer 0 has no preceding layer to hide its lookup behind")
            eager = triton.testing.do_bench(lambda: step(mode), warmup=50, rep=300)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(mode)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step(mode)
            graph = triton.testing.do_bench(g.replay, warmup=50, rep=300)
            results[T][mode] = {"eager_ms": eager, "graph_ms": graph}
            print(f"T={T:6d} {mode:16s} eager {eager:8.3f} ms  graph {graph:8.3f} ms", flush=True)
        lk = triton.testing.do_bench(lambda: lookup(w_host, s_host))
        results[T]["lookup_host_ms"] = lk
        gpu = results[T]["GPU-resident"]["graph_ms"]
        results[T]["prefetch_overhead_vs_gpu"] = results[T]["host + prefetch"]["graph_ms"] / gpu - 1
        results[T]["serial_overhead_vs_gpu"] = results[T]["host serial"]["graph_ms"] / gpu - 1

    report = {
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node()},
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "params": {"table_bytes": w_host.nbytes + s_host.nbytes, "layers": args.layers, "ple_layers": sorted(ple_layers),
                   "ffn": args.ffn, "heads": H, "dim": D},
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_prefetch.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "bench_prefetch.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    tokens = list(res)
    modes = ("GPU-resident", "host + prefetch", "host serial")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("eager_ms", "graph_ms")):
        for k, m in enumerate(modes):
            rel = [res[t][m][key] / res[t]["GPU-resident"][key] for t in tokens]
            ax.bar([i + k * 0.27 for i in range(len(tokens))], rel, 0.27, label=m)
        ax.set_xticks([i + 0.27 for i in range(len(tokens))], [f"{t} tok" for t in tokens])
        ax.set_ylim(0.9, None)
        ax.set_ylabel("step time / GPU-resident")
        ax.set_title(key.replace("_ms", ""))
        ax.legend(fontsize=8)
    fig.suptitle(f"PLE prefetch, {report['params']['layers']} layers, PLE at {report['params']['ple_layers']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
