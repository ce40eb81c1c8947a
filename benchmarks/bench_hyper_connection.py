"""One hyper-connection at the release's shape (hc 4 x hidden 2560, rank 320), torch ops against the kernels of
`kernels.hyper_connection` and `kernels.down_silu`, side by side in one run, each replayed as a CUDA graph (what a
FULL_DECODE_ONLY decode step is) and, for prefill sizes (eager in that mode), eagerly too.

    python -m benchmarks.bench_hyper_connection [--tokens 1 4 8 32 48 256 4096 16384] [--weights 16] [--sweep]
                                                [--out benchmarks/results/hyper_connection]

Both variants run the same block: the pending injection fused into (kernels) or ahead of (torch) the grouped
norm, the merged down + injection GEMM, the scaled silu, the up GEMM and the gated mix. The GEMMs are
`F.linear` in both; the merged one writes rows padded to 16 columns (336), as the model's does, and
`kernels_unpadded` runs the kernels with its 324-column rows, which cuBLAS serves with align-2 kernels.
`kernels_down_silu` (up to `DOWN_SILU_MAX_TOKENS`; the model fuses up to 16 tokens) does the merged GEMM and the silu in
one Triton launch, over the 324 rows that are not padding; `kernels_down_silu_no_pdl` the same without programmatic dependent launch (`ratio_pdl`: what it
brings; the kernels use it where the GPU has it, NVIDIA from Hopper). Each timed run goes through `--weights`
hyper-connections with weights of their own (16 by default: 220 MB, beyond the H200's 50 MB L2, as a decode step's
97 hyper-connections read theirs from HBM; 1: one weight set replayed from L2) and tile counters of their own (as
the model's modules: cold in L2 at each launch), reported per hyper-connection.
`--sweep`: `down_silu` alone over launch configs (`DownSiluConfig`: K splits, column and K blocks, warps) at decode
sizes against cuBLAS + the silu kernel, the same weights, and `gate_mix` over its column block. Where vLLM 0.33 and
NVIDIA's CuTe DSL are installed (`tools/gpu_cute_dsl.sh`), the sweep also times vLLM's own class's fused kernel
(`vllm_cute`, `default_vs_vllm_cute`): the limit `down_silu` is held to. Then the default, the 8 fastest launches,
CuTe's and cuBLAS + silu again, each inside the whole block (`down_silu_in_block`: what serving sees; serving
at b = 16 ranks the launches as this does). Reported: µs per hyper-connection, the ratios torch / kernels, unpadded /
padded and cuBLAS + silu / fused, every variant's outputs' largest difference from torch's, and the sweep's µs per
config with its best. Writes JSON + PNG into `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import platform
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from benchmarks.common import commit
from qwen4_exp_hcu.env import PDL_ENV
from qwen4_exp_hcu.kernels import down_silu as ds
from qwen4_exp_hcu.kernels import hyper_connection as hc

HC, HIDDEN, RANK = 4, 2560, 320
PAD = -(RANK + HC) % 16  # the merged GEMM's rows padded to 16 columns (`model.hyper_connection.GatedResidual`)

TORCH = (hc.inject_norm_reference, hc.scaled_silu_reference, hc.gate_mix_reference)
KERNELS = (hc.inject_norm, hc.scaled_silu, hc.gate_mix)
OPS = {"torch": (TORCH, PAD), "kernels": (KERNELS, PAD), "kernels_unpadded": (KERNELS, 0), "kernels_down_silu": (KERNELS, PAD),
       "kernels_down_silu_no_pdl": (KERNELS, PAD)}  # fmt: skip
DECODE_ONLY = ("kernels_down_silu", "kernels_down_silu_no_pdl")  # up to DOWN_SILU_MAX_TOKENS


def no_pdl(name: str):
    """The variant's launches without programmatic dependent launch (`kernels_*_no_pdl`), else as the GPU allows."""
    return mock.patch.dict(os.environ, {PDL_ENV: "0"}) if name.endswith("_no_pdl") else contextlib.nullcontext()


def fused_down(x, w, counts, config: ds.DownSiluConfig | None = None):
    """`down_silu` over the merged weight's rows that are not padding, as the model passes them (`config`: a launch;
    None: the default's)."""
    return ds.down_silu(x, w[: RANK + HC], RANK, float(HC), counts, config or ds.DownSiluConfig())


def block(variant: str, streams, pending, norm_w, down_w, up_w, counts, down=fused_down):
    """One hyper-connection of `variant` (its ops and padding, `OPS`): (the streams, the mix and its weights).
    `down(normed, padded weight, counts)`: the fused variants' down GEMM + silu."""
    (inject_norm, scaled_silu, gate_mix), pad = OPS[variant]
    streams, normed = inject_norm(streams, norm_w, 1e-6, HIDDEN, *pending)
    if variant in DECODE_ONLY:
        silu, rest = down(normed, down_w, counts)
        return streams, gate_mix(F.linear(silu, up_w), normed, HC, rest[:, :HC])
    down, logits = F.linear(normed, down_w[: RANK + HC + pad]).split([RANK, HC, pad], -1)[:2]
    return streams, gate_mix(F.linear(scaled_silu(down, float(HC)), up_w), normed, HC, logits)


SWEEP_TOKENS = (1, 4, 16, 32)


def sweep_configs(tokens: int) -> list[ds.DownSiluConfig]:
    """The launches around the defaults (16 splits, 4 warps; one token: 4 columns, K 1 024; more: 16 columns,
    K 128-256). One token (multiply-adds): 2-16 columns; 10 or 20 splits cover K = 10 240 in whole K blocks of 1 024
    or 512 (16 would leave 6 splits idle) or 1 split stepping through whole rows. More tokens (`tl.dot`: 16
    columns): K splits and blocks, 4 warps (8 is slower everywhere). Not swept, being no faster: K blocks in
    flight (Triton's `num_stages`), and 10 splits of one 1 024-wide K block. Split-K touches its counters early
    (`warm_counter`, the default: each module's counters are cold at its launch), and two launches also without
    it, which keeps the difference measured. At every size also `whole_rows` (vLLM's CuTe FMA kernel's scheme,
    1-2 columns a program, every weight loaded before the wait; above 4 tokens a program per 4 rows, slower than
    split-K there)."""
    whole = [ds.DownSiluConfig(whole_rows=True, block_n=n, num_warps=w) for n, w in itertools.product((1, 2), (2, 4, 8))]
    if tokens > ds.WHOLE_ROWS_PER_PROGRAM:  # the two best there (ptxas at sm_90a: no spills, a few at 4 columns)
        whole = [ds.DownSiluConfig(whole_rows=True, block_n=n, num_warps=w) for n, w in ((1, 4), (4, 8))]
    if tokens == 1:
        grid = itertools.product((2, 4, 8, 16), (1, 10, 16, 20), (512, 1024), (2, 4))
        return [ds.DownSiluConfig(split=s, block_n=n, block_k=k, num_warps=w, warm_counter=False, whole_rows=False)
                for n, s, k, w in grid] + whole  # fmt: skip
    grid = [(s, k, True) for s, k in itertools.product((8, 10, 16, 20, 40), (128, 256, 512))]
    grid += [(s, k, False) for s, k in ((10, 256), (16, 128))]  # the defaults above and up to 16 tokens, counters cold
    return [ds.DownSiluConfig(split=s, block_n=16, block_k=k, num_warps=4, warm_counter=wc, whole_rows=False)
            for s, k, wc in grid] + whole  # fmt: skip


def weight_sets(n: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`n` sets of (norm, merged down + injection, up) weights and `down_silu`'s tile counters, each
    hyper-connection's own."""
    dev, dt = "cuda", torch.bfloat16
    return [(torch.randn(HC * HIDDEN, device=dev, generator=g).to(dt) * 0.1,
             (torch.randn(RANK + HC + PAD, HC * HIDDEN, device=dev, generator=g) / 100).to(dt),
             (torch.randn(HC * HIDDEN, RANK, device=dev, generator=g) / 20).to(dt),
             torch.zeros(ds.DOWN_SILU_TILES, dtype=torch.int32, device=dev)) for _ in range(n)]  # fmt: skip


def config_row(per, baseline: tuple, configs: list, label, launch, wrong=lambda c: None) -> dict:
    """µs of `baseline` (name, launch over a weight and its counters) and of `launch(weight, counters, config)` per
    config, timed by `per`; a config Triton cannot compile here (registers, shared memory), or whose output `wrong`
    faults (a message), is reported under `failed`, not fatal to the sweep and never its best. Then the best, its
    ratio to the baseline, and the default launch's (`None`)."""
    name, base = baseline
    row = {name: per(base)}
    for c in configs:
        try:
            if fault := wrong(c):
                raise ValueError(fault)
            row[label(c)] = per(lambda w, counts, c=c: launch(w, counts, c))
        except Exception as e:
            row.setdefault("failed", {})[label(c)] = f"{type(e).__name__}: {str(e)[:200]}"
    best = min((k for k, v in row.items() if k != name and isinstance(v, float)), key=row.get)
    row["best"], row[f"best_vs_{name}"] = best, row[name] / row[best]
    row[f"default_vs_{name}"] = row[name] / per(lambda w, counts: launch(w, counts, None))
    return row


def vllm_down_silu():
    """vLLM 0.33's class's fused down GEMM + silu (NVIDIA's CuTe DSL: `fma` up to 4 rows, split-K `mma` above), or
    None where vLLM or the DSL is missing."""
    try:
        import cutlass  # noqa: F401  the DSL, which vLLM's module imports only when it compiles
        from vllm.models.qwen4_exp.nvidia.ops.cute_dsl.hc_down_silu import hc_down_silu
    except ImportError:
        return None
    return hc_down_silu


def off_reference(got: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Where a launch's (silu, rest) is more than two bf16 steps of the largest value off the torch reference (what
    tests/test_hyper_connection.py allows): a message, so that a wrong launch cannot win the sweep."""
    for name, a, b in zip(("silu", "rest"), got, ds.down_silu_reference(x, w[: RANK + HC], RANK, float(HC)), strict=True):
        err, bound = (a.float() - b.float()).abs().max().item(), 2 * torch.finfo(b.dtype).eps * b.float().abs().max().item()
        if not err <= bound:
            return f"{name} {err:.3g} off the reference (bound {bound:.3g})"
    return None


def sweep(weights, g: torch.Generator) -> dict:
    """µs per `down_silu` (the GEMM and the silu alone) per launch config, and cuBLAS + the silu kernel, per token
    count, each run going through every weight set; and vLLM's class's kernel where it is installed."""
    cute = vllm_down_silu()
    out = {}
    for t in SWEEP_TOKENS:
        x = torch.randn(t, HC * HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        per = lambda f: do_bench_cudagraph(lambda: [f(w, counts) for _, w, _, counts in weights], rep=50) * 1e3 / len(weights)  # noqa: E731
        launch = lambda w, counts, c: fused_down(x, w, counts, c)  # noqa: E731
        row = config_row(
            per, ("cublas_silu", lambda w, _: hc.scaled_silu(F.linear(x, w)[:, :RANK], float(HC))), sweep_configs(t),
            ds.DownSiluConfig.label, launch, lambda c: off_reference(launch(weights[0][1], weights[0][3], c), x, weights[0][1]),
        )  # fmt: skip
        with no_pdl("_no_pdl"):
            row["default_no_pdl_vs_cublas_silu"] = row["cublas_silu"] / per(lambda w, counts: fused_down(x, w, counts))
        if cute is not None:  # compiled (JIT) outside the timed graphs, checked against the reference
            w = weights[0][1]
            silu = cute(x, w, RANK, HC)[0]
            row["vllm_cute_max_abs_diff"] = (silu.float() - ds.down_silu_reference(x, w, RANK, float(HC))[0].float()).abs().max().item()
            row["vllm_cute"] = per(lambda w, _: cute(x, w, RANK, HC))
            row["default_vs_vllm_cute"] = row["vllm_cute"] * row["default_vs_cublas_silu"] / row["cublas_silu"]
            print("sweep", t, f"vLLM's CuTe kernel {row['vllm_cute']:.2f} us: the default runs at {row['default_vs_vllm_cute']:.2f}x its speed", flush=True)
        out[t] = row
        print("sweep", t, row["best"], f"{row[row['best']]:.2f} us", f"vs cuBLAS + silu {row['best_vs_cublas_silu']:.2f}x "
              f"(default {row['default_vs_cublas_silu']:.2f}x, without PDL {row['default_no_pdl_vs_cublas_silu']:.2f}x)", flush=True)  # fmt: skip
    return out


def block_candidates(alone: dict, n: int = 8) -> dict[str, ds.DownSiluConfig]:
    """The default launch and the `n` fastest of a token count's alone sweep, by label."""
    timed = sorted((v, k) for k, v in alone.items() if k.startswith(("rows_", "split")) and isinstance(v, float))
    return {"default": ds.DownSiluConfig()} | {k: ds.DownSiluConfig.parse(k) for _, k in timed[:n]}


def block_sweep(weights, g: torch.Generator, alone: dict, cute) -> dict:
    """µs per hyper-connection with each of `block_candidates`' launches, vLLM's CuTe kernel and cuBLAS + the silu
    in its place, the whole block around it as a decode step runs it (the norm before, the up GEMM and `gate_mix`
    after): the alone sweep replays one kernel back to back, each launch overlapping its own predecessor through
    dependent launch, and predicts serving poorly (at b = 16 our split-K serves at 1.3-1.4x its alone time,
    CuTe's at 1.1x). Also the default without dependent launch, as CuTe runs above one row."""
    out = {}
    for t in SWEEP_TOKENS:
        streams = torch.randn(t, HC * HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        pending = (torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16),
                   torch.rand(t, HC, device="cuda", generator=g).to(torch.bfloat16) * 2)  # fmt: skip

        def per(variant, down=fused_down):
            run = lambda: [block(variant, streams, pending, *w, down) for w in weights]  # noqa: E731
            return do_bench_cudagraph(run, rep=50) * 1e3 / len(weights)

        row = {"cublas_silu": per("kernels")}
        for label, c in block_candidates(alone[t]).items():
            row[label] = per("kernels_down_silu", functools.partial(fused_down, config=c))
        with no_pdl("_no_pdl"):
            row["default_no_pdl"] = per("kernels_down_silu_no_pdl")
        if cute is not None:
            row["vllm_cute"] = per("kernels_down_silu", lambda x, w, _: cute(x, w, RANK, HC))  # padded, as vLLM's class
            row["default_vs_vllm_cute"] = row["vllm_cute"] / row["default"]
        row["best"] = min((k for k in row if k.startswith(("rows_", "split"))), key=row.get)
        out[t] = row
        print("in block", t, {k: v if isinstance(v, str) else round(v, 2) for k, v in row.items()}, flush=True)
    return out


GATE_MIX_BLOCKS = (128, 256, 512, 1024)


def gate_mix_sweep(g: torch.Generator, launches: int = 16) -> dict:
    """µs per `gate_mix` launch per column block (one program per block and row: 1 024 gives a token 3 programs;
    vLLM's class's gate-mix kernel is the limit)."""
    out = {}
    for t in SWEEP_TOKENS:
        up, normed = (torch.randn(t, HC * HIDDEN, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        logits = torch.randn(t, HC, device="cuda", generator=g).to(torch.bfloat16)
        row = {str(b): do_bench_cudagraph(lambda b=b: [hc.gate_mix(up, normed, HC, logits, b) for _ in range(launches)], rep=50) * 1e3 / launches
               for b in GATE_MIX_BLOCKS}  # fmt: skip
        row["best"] = min(row, key=row.get)
        out[t] = row
        print("gate_mix sweep", t, {k: v if k == "best" else round(v, 2) for k, v in row.items()}, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32, 48, 256, 4096, 16384])
    parser.add_argument("--weights", type=int, default=16, help="weight sets per timed run (1: replayed from L2)")
    parser.add_argument("--sweep", action="store_true", help="also sweep down_silu's launch configs")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "hyper_connection"))
    args = parser.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weights = weight_sets(args.weights, g)
    results = {}
    for t in args.tokens:
        streams = torch.randn(t, HC * HIDDEN, device=dev, generator=g).to(dt)
        pending = (torch.randn(t, HIDDEN, device=dev, generator=g).to(dt), torch.rand(t, HC, device=dev, generator=g).to(dt) * 2)
        row, outputs = {}, {}
        for name in (n for n in OPS if n not in DECODE_ONLY or t <= ds.DOWN_SILU_MAX_TOKENS):
            run = lambda: [block(name, streams, pending, *w) for w in weights]  # noqa: E731
            with no_pdl(name):
                outputs[name] = run()[0]
                row[name] = {"graph_us": do_bench_cudagraph(run, rep=200) * 1e3 / len(weights)}
                if t >= 4096:  # prefill sizes: FULL_DECODE_ONLY runs them eagerly
                    row[name]["eager_us"] = do_bench(run, rep=200) * 1e3 / len(weights)
        leaves = {name: torch.utils._pytree.tree_leaves(out) for name, out in outputs.items()}
        row["max_abs_diff"] = {
            name: max((a.float() - b.float()).abs().max().item() for a, b in zip(leaves["torch"], leaves[name], strict=True))
            for name in outputs if name != "torch"
        }  # fmt: skip
        row["ratio_graph"] = row["torch"]["graph_us"] / row["kernels"]["graph_us"]
        row["ratio_padding"] = row["kernels_unpadded"]["graph_us"] / row["kernels"]["graph_us"]
        if "kernels_down_silu" in row:
            row["ratio_down_silu"] = row["kernels"]["graph_us"] / row["kernels_down_silu"]["graph_us"]
            row["ratio_pdl"] = row["kernels_down_silu_no_pdl"]["graph_us"] / row["kernels_down_silu"]["graph_us"]
        results[t] = row
        print(t, json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "what": "one hyper-connection (inject + norm + merged GEMM + silu + up GEMM + gated mix), µs",
        "shape": {"hc": HC, "hidden": HIDDEN, "rank": RANK, "dtype": "bfloat16"},
        "weights": args.weights,
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__},
        "command": f"python -m benchmarks.bench_hyper_connection --tokens {' '.join(map(str, args.tokens))} "
                   f"--weights {args.weights}" + (" --sweep" if args.sweep else ""),
        "commit": commit(),
        "results": results,
    }  # fmt: skip
    (out / "bench_hyper_connection.json").write_text(json.dumps(report, indent=2))  # before the sweep: a cut-off run keeps it
    if args.sweep:
        report["down_silu_sweep"] = sweep(weights, g)
        report["down_silu_in_block"] = block_sweep(weights, g, report["down_silu_sweep"], vllm_down_silu())
        report["gate_mix_sweep"] = gate_mix_sweep(g)
        (out / "bench_hyper_connection.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "bench_hyper_connection.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = list(report["results"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in OPS:
        shown = [i for i, t in enumerate(tokens) if name in report["results"][t]]
        ax.plot(shown, [report["results"][tokens[i]][name]["graph_us"] for i in shown], marker="o", label=name)
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("µs per hyper-connection (CUDA graph)")
    ax.set_title(f"Hyper-connection glue, hc {HC} x {HIDDEN}, {report['weights']} weight sets, {report['machine']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
