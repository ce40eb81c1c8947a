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
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from benchmarks.common import bench_config, commit, save
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace
from qwen4_exp_hcu.ple.storage import PLEStorage

HIDDEN = 2048
MODES = ("GPU-resident", "host + prefetch", "host serial")


def ple_layer(spec_cfg, host: bool) -> PLELayer:
    layer = PLELayer(spec_cfg, 0, PLEStorage("int8", "cuda", host=host))
    for a in range(0, layer.table.weight.shape[0], 1 << 24):  # any bytes do for timing
        layer.table.weight[a : a + (1 << 24)].fill_(a % 127)
    layer.table.scale.fill_(0.01)
    return layer


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table-gb", type=float, default=12.0)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--ple-layers", default="1,21", help="0-indexed decoder layers carrying PLE")
    ap.add_argument("--ffn", type=int, default=65536)
    ap.add_argument("--tokens", default="64,256,4096,16384")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per mode; the median is kept")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    args.ple_layers = sorted(int(x) for x in args.ple_layers.split(","))
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if 0 in args.ple_layers:
        raise SystemExit("layer 0 has no preceding layer to hide its lookup behind")
    return args


@dataclass
class Stack:
    """The decoder-layer stand-ins' weights, the PLE layer with its table on the host and on the GPU, and the
    prefetch workspace (one handle per PLE layer)."""

    args: argparse.Namespace
    host: PLELayer
    gpu: PLELayer
    up: torch.Tensor
    down: torch.Tensor
    kv: torch.Tensor  # key (hc=4) + value projection
    workspace: PrefetchWorkspace

    @classmethod
    def build(cls, args: argparse.Namespace) -> Stack:
        cfg = bench_config(int(args.table_gb * 1e9) // 130, 8, 128)
        host, gpu = ple_layer(cfg, host=True), ple_layer(cfg, host=False)
        H, D = host.spec.num_heads, host.spec.head_dim
        weights = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.01
                   for shape in ((HIDDEN, args.ffn), (args.ffn, HIDDEN), (H * D, 5 * HIDDEN))]  # fmt: skip
        workspace = PrefetchWorkspace([host] * len(args.ple_layers), max(args.tokens), "cuda")
        return cls(args, host, gpu, *weights, workspace)

    def step(self, mode: str, batch: PLEBatch, state: PLEState, x: torch.Tensor) -> torch.Tensor:
        """One forward of the stack in `mode` (`MODES`)."""
        ple, h = self.args.ple_layers, x
        for li in range(self.args.layers):
            if mode == "host + prefetch" and li + 1 in ple:  # start before the preceding layer
                self.workspace.handles[ple.index(li + 1)].start(batch, state)
            if li in ple:
                if mode == "host + prefetch":
                    emb = self.workspace.handles[ple.index(li)].wait()
                else:
                    emb = (self.gpu if mode == "GPU-resident" else self.host).lookup(batch, state)
                h = h + (emb @ self.kv)[:, :HIDDEN]
            h = torch.relu(h @ self.up) @ self.down
        return h


def graphs(run) -> dict[str, torch.cuda.CUDAGraph]:
    """`run(mode)` captured in a CUDA graph per mode, after a warm-up on a side stream."""
    out = {}
    for mode in MODES:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(mode)
        torch.cuda.current_stream().wait_stream(s)
        out[mode] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(out[mode]):
            run(mode)
    return out


def measure(stack: Stack, T: int) -> dict:
    """Step time of every mode at `T` tokens, eager and replayed from a graph (the median of `--repeats`
    interleaved runs), the lookup alone, and the host modes' overhead against the GPU-resident table."""
    batch = PLEBatch.from_lengths(torch.randint(0, 248_320, (T,), device="cuda"), [T], [0], [False])
    state = PLEState.zeros(stack.host.state_shapes(), 1, torch.bfloat16, "cuda")
    x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    run = lambda mode: stack.step(mode, batch, state, x)  # noqa: E731
    captured = graphs(run)
    times = {m: {"eager_ms": [], "graph_ms": []} for m in MODES}
    for _ in range(stack.args.repeats):  # interleave modes so drift hits them alike
        for mode in MODES:
            times[mode]["eager_ms"].append(triton.testing.do_bench(lambda: run(mode), warmup=20, rep=150))
            times[mode]["graph_ms"].append(triton.testing.do_bench(captured[mode].replay, warmup=20, rep=150))
    result = {m: {k: statistics.median(v) for k, v in times[m].items()} for m in MODES}
    for mode in MODES:
        print(f"T={T:6d} {mode:16s} eager {result[mode]['eager_ms']:8.3f} ms  graph {result[mode]['graph_ms']:8.3f} ms", flush=True)
    result["lookup_host_ms"] = triton.testing.do_bench(lambda: stack.host.lookup(batch, state))
    result["lookup_gpu_ms"] = triton.testing.do_bench(lambda: stack.gpu.lookup(batch, state))
    for kind in ("eager_ms", "graph_ms"):
        base = result["GPU-resident"][kind]
        result[f"prefetch_overhead_vs_gpu_{kind[:-3]}"] = result["host + prefetch"][kind] / base - 1
        result[f"serial_overhead_vs_gpu_{kind[:-3]}"] = result["host serial"][kind] / base - 1
    return result


def main() -> None:
    args = parse_args()
    stack = Stack.build(args)
    results = {T: measure(stack, T) for T in args.tokens}
    table = stack.host.table
    report = {
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node()},
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "params": {"table_bytes": table.nbytes, "layers": args.layers, "ple_layers": args.ple_layers, "ffn": args.ffn,
                   "heads": stack.host.spec.num_heads, "dim": stack.host.spec.head_dim, "repeats": args.repeats,
                   "host_tuning": table.HOST_TUNING},
        "results": results,
        "command": shlex.join(["python", "-m", "benchmarks.bench_prefetch", *sys.argv[1:]]),
        "commit": commit(),
    }  # fmt: skip
    save(args.out, "bench_prefetch", report, plot)


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    res = report["results"]
    tokens = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("eager_ms", "graph_ms")):
        for k, m in enumerate(MODES):
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
