"""Does the prefetch hide an offloaded PLE lookup? Step time of a decoder stack, three table set-ups.

    python -m benchmarks.bench_prefetch [--table-gb 12] [--layers 40] [--ple-layers 1,21] [--out benchmarks/results]

A stack of `--layers` decoder-layer stand-ins (hidden 2048, a dense up/down matmul pair of `--ffn` width:
~0.54 GB of bf16 weights per layer, less than a real Qwen4Exp MoE layer reads at decode, so hiding the
lookup here is the harder case) with a PLE lookup (n-gram hash + fused gather/dequant, 16 heads of 128 B
rows, then the key/value projection) at each PLE layer. Modes: table GPU-resident; host-offloaded with the
lookup started on a side stream before the preceding layer (PrefetchWorkspace's fork/join); host-offloaded
serial. Eager and CUDA-graph replay. Decode 64/256 tokens, prefill 4k/16k. Writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch
import triton

from benchmarks import save
from benchmarks.bench_lookup import bench_config
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace
from qwen4_exp_hcu.ple.storage import PLEStorage

HIDDEN = 2048


def ple_layer(spec_cfg, host: bool) -> PLELayer:
    layer = PLELayer(spec_cfg, 0, PLEStorage("int8", "cuda", host=host))
    for a in range(0, layer.table.weight.shape[0], 1 << 24):  # any bytes do for timing
        layer.table.weight[a : a + (1 << 24)].fill_(a % 127)
    layer.table.scale.fill_(0.01)
    return layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=12.0)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--ple-layers", default="1,21", help="0-indexed decoder layers carrying PLE")
    ap.add_argument("--ffn", type=int, default=65536)
    ap.add_argument("--tokens", default="64,256,4096,16384")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per mode; the median is kept")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    ple_layers = sorted(int(x) for x in args.ple_layers.split(","))
    if 0 in ple_layers:
        raise SystemExit("layer 0 has no preceding layer to hide its lookup behind")
    cfg = bench_config(int(args.table_gb * 1e9) // 130, 8, 128)
    host, gpu = ple_layer(cfg, host=True), ple_layer(cfg, host=False)
    H, D = host.spec.num_heads, host.spec.head_dim
    up = torch.randn(HIDDEN, args.ffn, device="cuda", dtype=torch.bfloat16) * 0.01
    down = torch.randn(args.ffn, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01
    kv = torch.randn(H * D, 5 * HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.01  # key (hc=4) + value proj
    max_t = max(int(t) for t in args.tokens.split(","))
    workspace = PrefetchWorkspace([host] * len(ple_layers), max_t, "cuda")
    results = {}

    for T in (int(t) for t in args.tokens.split(",")):
        batch = PLEBatch.from_lengths(torch.randint(0, 248_320, (T,), device="cuda"), [T], [0], [False])
        state = PLEState.zeros(host.state_shapes(), 1, torch.bfloat16, "cuda")
        x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)

        def step(mode):
            h = x
            for li in range(args.layers):
                if mode == "host + prefetch" and li + 1 in ple_layers:  # start before the preceding layer
                    workspace.handles[ple_layers.index(li + 1)].start(batch, state)
                if li in ple_layers:
                    if mode == "host + prefetch":
                        emb = workspace.handles[ple_layers.index(li)].wait()
                    else:
                        emb = (gpu if mode == "GPU-resident" else host).lookup(batch, state)
                    h = h + (emb @ kv)[:, :HIDDEN]
                h = torch.relu(h @ up) @ down
            return h

        modes = ("GPU-resident", "host + prefetch", "host serial")
        graphs = {}
        for mode in modes:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step(mode)
            torch.cuda.current_stream().wait_stream(s)
            graphs[mode] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[mode]):
                step(mode)
        times = {m: {"eager_ms": [], "graph_ms": []} for m in modes}
        for _ in range(args.repeats):  # interleave modes so drift hits them alike
            for mode in modes:
                times[mode]["eager_ms"].append(triton.testing.do_bench(lambda: step(mode), warmup=20, rep=150))
                times[mode]["graph_ms"].append(triton.testing.do_bench(graphs[mode].replay, warmup=20, rep=150))
        results[T] = {m: {k: statistics.median(v) for k, v in times[m].items()} for m in modes}
        for mode in modes:
            print(f"T={T:6d} {mode:16s} eager {results[T][mode]['eager_ms']:8.3f} ms  graph {results[T][mode]['graph_ms']:8.3f} ms", flush=True)
        results[T]["lookup_host_ms"] = triton.testing.do_bench(lambda: host.lookup(batch, state))
        results[T]["lookup_gpu_ms"] = triton.testing.do_bench(lambda: gpu.lookup(batch, state))
        for kind in ("eager_ms", "graph_ms"):
            base = results[T]["GPU-resident"][kind]
            results[T][f"prefetch_overhead_vs_gpu_{kind[:-3]}"] = results[T]["host + prefetch"][kind] / base - 1
            results[T][f"serial_overhead_vs_gpu_{kind[:-3]}"] = results[T]["host serial"][kind] / base - 1
        del graphs

    report = {
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node()},
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "params": {"table_bytes": host.table.nbytes, "layers": args.layers, "ple_layers": ple_layers,
                   "ffn": args.ffn, "heads": H, "dim": D, "repeats": args.repeats, "host_tuning": host.table.HOST_TUNING},
        "results": results,
    }
    save(args.out, "bench_prefetch", report, plot)


def plot(report: dict, path: Path) -> None:
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
