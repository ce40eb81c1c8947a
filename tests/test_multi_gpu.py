"""Two GPUs, NCCL: ETP lookup with pinned-host tables, prefetch inside a captured CUDA graph, exact.

One process per GPU (``cuda:{rank}``). Topologies: TP2 (one ETP group, both ranks the same tokens) and
DP2 with ``embedding_across_dp`` (one ETP group, different tokens per rank, max_tokens = the graph's static
token count). Tables in pinned host memory (``host_table=True``), read by the fused kernel over UVA.

Per topology:
* eager, uneven real token counts (one step with none), prefetch off/on, max_tokens not passed/passed:
  every output and state equals a single-GPU reference (``PLELayer`` with group None, same GPU) bit for bit;
* CUDA graph: ``PrefetchWorkspace.start`` + ``wait`` + ``forward`` of both PLE layers captured in one
  ``torch.cuda.graph`` (NCCL collectives on the side stream, warmed up eagerly before capture), replayed
  over prefill + decode steps with new inputs copied into static buffers (padding requests and tokens
  fill the static batch). Checked bit for bit against the reference captured the same way (same kernels,
  same shapes); the prefetched embeddings also bit for bit against an eager reference lookup, and the
  outputs against the eager reference forward within 1e-5 (eager vs graph may pick other GEMM kernels;
  the JSON records whether they were bitwise equal too).
Per-step ETP bytes and times (tiny layers, plus a lookup-only benchmark with the real head geometry:
16 heads x 128-wide INT8 rows) go to ``benchmarks/results/etp_2gpu.json``, written only when this runs.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import compare_steps, init_process_group, max_abs_diff, qsl_of, random_ple_state_dict, spawn_workers, write_result
from ple_configs import EOS, tiny_text_config
from qwen4_exp_hcu.ple.etp import TorchGroup
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace

pytestmark = pytest.mark.multi_gpu

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "etp_2gpu.json"
CAP = 16  # static token count of the graph = workspace capacity
B_STATIC = 4  # static request count; unused ones are padding requests (slot -1, no tokens)
SLOTS = 8
LAYERS = ((0, True), (1, False))  # (ple_layer_index, INT8 table?)
PAD = (-1, 0, True)
# per DP replica, per step: (slot, tokens, has_initial_state); each replica: prefill, then decode steps
SCHEDULES = (
    ([(3, 9, False), (0, 4, False)], [(3, 1, True), (0, 1, True)], [(3, 1, True), (0, 1, True)], [PAD]),
    ([(1, 2, False)], [(1, 1, True), (5, 6, False)], [(1, 1, True), (5, 1, True)], [(5, 1, True), (6, 3, False)]),
)
NSTEPS = len(SCHEDULES[0])
MAX_T = [max(sum(n for _, n, _ in s[step]) for s in SCHEDULES) for step in range(NSTEPS)]
BENCH_TOKENS = (64, 256, 2048)
BENCH_ITERS = 20


def _build(cfg, sds, dev, group, across):
    return [
        PLELayer.from_state_dict(
            cfg, i, sd, quantized=q, dtype=torch.float32, device=dev, host_table=True, etp_group=group, across_dp=across
        )
        for (i, q), sd in zip(LAYERS, sds)
    ]


def _new_states(layers, dev):
    out = []
    for layer in layers:
        ctx_shape, conv_shape = layer.state_shapes()
        out.append((torch.zeros(SLOTS, *ctx_shape, dtype=torch.int64, device=dev), torch.zeros(SLOTS, *conv_shape, device=dev)))
    return out


def _zero(states):
    for a, b in states:
        a.zero_()
        b.zero_()


def _step_inputs(cfg, dp, step, dev):
    reqs = SCHEDULES[dp][step]
    g = torch.Generator().manual_seed(100 * dp + step)
    T = sum(n for _, n, _ in reqs)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    if (dp, step) == (0, 0):
        ids[3] = EOS
    C = cfg.hidden_size * cfg.hc_count
    x = {
        "ids": ids,
        "qsl": qsl_of([n for _, n, _ in reqs]),
        "slots": torch.tensor([s for s, _, _ in reqs], dtype=torch.int64),
        "init": torch.tensor([h for _, _, h in reqs], dtype=torch.bool),
        "hs": [torch.randn(T, C, generator=g) for _ in LAYERS],
    }
    return {k: ([t.to(dev) for t in v] if isinstance(v, list) else v.to(dev)) for k, v in x.items()}


def _eager_steps(cfg, layers, states, dp, dev, prefetch, max_tokens_mode, ws):
    """Real (uneven) shapes, no graph: [(outputs, states)] per step."""
    record = []
    for step in range(NSTEPS):
        x = _step_inputs(cfg, dp, step, dev)
        mt = MAX_T[step] if max_tokens_mode == "exact" else None
        look = lambda i: (x["ids"], x["qsl"], x["slots"], states[i][0], x["init"])  # noqa: E731
        if prefetch:
            for i in range(len(layers)):
                ws.start(i, *look(i), max_tokens=mt)
        outs = []
        for i, layer in enumerate(layers):
            emb = ws.wait(i) if prefetch else (layer.lookup(*look(i), max_tokens=mt) if mt is not None else None)
            outs.append(layer(x["hs"][i], x["ids"], x["qsl"], x["slots"], *states[i], x["init"], embeddings=emb))
        record.append(([o.clone() for o in outs], [(a.clone(), b.clone()) for a, b in states]))
    return record


class Static:
    """Persistent graph inputs; `fill` copies a real batch in and pads it to CAP tokens / B_STATIC requests."""

    def __init__(self, C, dev):
        self.ids = torch.zeros(CAP, dtype=torch.int64, device=dev)
        self.qsl = torch.zeros(B_STATIC + 1, dtype=torch.int32, device=dev)
        self.slots = torch.full((B_STATIC,), -1, dtype=torch.int64, device=dev)
        self.init = torch.ones(B_STATIC, dtype=torch.bool, device=dev)
        self.hs = [torch.zeros(CAP, C, device=dev) for _ in LAYERS]
        self.busy, self.busy_out = torch.randn(1024, 1024, device=dev), torch.empty(1024, 1024, device=dev)

    def fill(self, x):
        T, B = x["ids"].shape[0], x["slots"].shape[0]
        assert T <= CAP and B < B_STATIC, "a trailing padding request must own the padding tokens"
        self.ids.zero_()
        self.ids[:T].copy_(x["ids"])
        self.qsl.fill_(T)
        self.qsl[: B + 1].copy_(x["qsl"])
        self.slots.fill_(-1)
        self.slots[:B].copy_(x["slots"])
        self.init.fill_(True)
        self.init[:B].copy_(x["init"])
        for h, src in zip(self.hs, x["hs"]):
            h.zero_()
            h[:T].copy_(src)
        return T

    def args(self, i, states):
        return self.hs[i], self.ids, self.qsl, self.slots, *states[i], self.init


def _capture(body, warmup=2):
    """Eager warm-up on a side stream (Triton JIT, NCCL communicator and channels, allocator), then capture
    `body`. capture_error_mode thread_local: the NCCL watchdog thread's event queries must not invalidate it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        outs = body()
    torch.cuda.synchronize()
    return g, outs


def _time_ms(fn, iters):
    """Median of per-call CUDA-event times on the current stream."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _topology_case(cfg, sds, rank, dev, name, group, across, dp, refs, static, ref_graph, ref_gstates, ref_gouts, failures):
    layers = _build(cfg, sds, dev, group, across)
    assert all(l.table.weight.is_pinned() for l in layers), "tables must be in pinned host memory"
    ws = PrefetchWorkspace(layers, CAP, dev)
    info = {"dp": dp, "rows": [[l.table.start, l.table.end] for l in layers],
            "bytes_per_token": [l.etp.bytes_per_token(l.spec.num_heads) for l in layers]}

    # 1. eager, real uneven shapes, vs the single-GPU reference at the same shapes
    want = _eager_steps(cfg, refs, _new_states(refs, dev), dp, dev, False, None, None)
    for prefetch in (False, True):
        for mode in (None, "exact"):
            got = _eager_steps(cfg, layers, _new_states(layers, dev), dp, dev, prefetch, mode, ws)
            compare_steps(got, want, f"{name} eager prefetch={prefetch} max_tokens={mode}", failures)

    # 2. one CUDA graph: prefetch start (side stream, NCCL inside) + wait + forward of both layers
    states = _new_states(layers, dev)

    def body():
        for i in range(len(layers)):
            ws.start(i, static.ids, static.qsl, static.slots, states[i][0], static.init, max_tokens=CAP)
        torch.mm(static.busy, static.busy, out=static.busy_out)  # the preceding decoder layer's work, main stream
        return [layer(*static.args(i, states), embeddings=ws.wait(i)) for i, layer in enumerate(layers)]

    static.fill(_step_inputs(cfg, dp, 0, dev))
    graph, outs = _capture(body)
    _zero(states)
    _zero(ref_gstates)
    eager_states = _new_states(refs, dev)
    bitwise_vs_eager, max_vs_eager = True, 0.0
    for step in range(NSTEPS):
        T = static.fill(_step_inputs(cfg, dp, step, dev))
        want_emb = [r.lookup(static.ids, static.qsl, static.slots, eager_states[i][0], static.init) for i, r in enumerate(refs)]
        graph.replay()
        ref_graph.replay()
        eager = [r(*static.args(i, eager_states)) for i, r in enumerate(refs)]
        torch.cuda.synchronize()
        label = f"{name} graph step {step}"
        for i in range(len(layers)):
            if not torch.equal(ws.buffers[i][:CAP], want_emb[i]):
                failures.append(f"{label} layer {i}: prefetched embeddings differ from the reference lookup")
            if not torch.equal(outs[i], ref_gouts[i]):
                failures.append(f"{label} layer {i}: output differs from the captured reference (max|diff| {max_abs_diff(outs[i], ref_gouts[i]):.3g})")
            for k, what in enumerate(("ngram_state", "conv_state")):
                if not torch.equal(states[i][k], ref_gstates[i][k]):
                    failures.append(f"{label} layer {i}: {what} differs from the captured reference")
            if not torch.equal(states[i][0], eager_states[i][0]):
                failures.append(f"{label} layer {i}: ngram_state differs from the eager reference")
            for a, b in ((outs[i][:T], eager[i][:T]), (states[i][1], eager_states[i][1])):
                d = max_abs_diff(a, b)
                max_vs_eager = max(max_vs_eager, d)
                bitwise_vs_eager &= torch.equal(a, b)
                if not d <= 1e-5:
                    failures.append(f"{label} layer {i}: graph vs eager reference max|diff| {d:.3g} > 1e-5")
    info["graph_bitwise_vs_eager_reference"] = bitwise_vs_eager
    info["graph_max_diff_vs_eager_reference"] = max_vs_eager

    # 3. per-step figures of the tiny layers: ETP bytes (static batch of CAP tokens) and replay times
    dist.barrier()
    info["graph_step"] = {
        "tokens_per_rank": CAP,
        "etp_bytes_per_rank": sum(b * CAP for b in info["bytes_per_token"]),
        "replay_ms_etp_prefetch": _time_ms(graph.replay, 50),
        "replay_ms_single_gpu_reference": _time_ms(ref_graph.replay, 50),
    }
    return info


def _bench(rank, dev, group, across):
    """Lookup only, real head geometry (16 heads x d=128, INT8 rows + bf16 scale, pinned host table):
    eager ETP lookup vs the single-GPU lookup, and the prefetch start+wait replayed from a CUDA graph."""
    cfg = tiny_text_config(
        ngram_size=3, heads_per_ngram=8, ple_embed_dim=16 * 128, ngram_vocab_size_base=200_003,
        make_ngram_vocab_size_divisible_by=128, split_ngram_parts=16, vocab_size=248_320,
    )
    etp = PLELayer(cfg, 0, quantized=True, device=dev, host_table=True, etp_group=group, across_dp=across)
    solo = PLELayer(cfg, 0, quantized=True, device=dev, host_table=True)
    full = torch.randint(-127, 127, (solo.table.rows, solo.table.dim), dtype=torch.int8, device=dev, generator=torch.Generator(dev).manual_seed(0))
    solo.table.weight.copy_(full)
    etp.table.weight.copy_(full[etp.table.start : etp.table.end])
    for t in (solo.table, etp.table):
        t.scale.fill_(0.01)
    del full
    H, rows = solo.spec.num_heads, []
    for T in BENCH_TOKENS:
        seed = 1000 + T + (rank if across else 0)
        ids = torch.randint(0, cfg.vocab_size, (T,), device=dev, generator=torch.Generator(dev).manual_seed(seed))
        args = (ids, torch.tensor([0, T], dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int64, device=dev),
                torch.zeros(1, 2, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.bool, device=dev))
        assert torch.equal(etp.lookup(*args, max_tokens=T), solo.lookup(*args))
        ws = PrefetchWorkspace([etp], T, dev)

        def prefetch():
            ws.start(0, *args, max_tokens=T)
            return ws.wait(0)

        graph, _ = _capture(prefetch)
        dist.barrier()
        rows.append({
            "tokens_per_rank": T,
            "bytes_per_token": etp.etp.bytes_per_token(H),
            "etp_bytes_per_rank": etp.etp.bytes_per_token(H) * T,
            "table_rows_owned": etp.table.end - etp.table.start,
            "lookup_ms_etp_eager": _time_ms(lambda: etp.lookup(*args, max_tokens=T), BENCH_ITERS),
            "lookup_ms_single_gpu_eager": _time_ms(lambda: solo.lookup(*args), BENCH_ITERS),
            "prefetch_ms_etp_graph": _time_ms(graph.replay, BENCH_ITERS),
        })
        del graph, ws
    return {"rows_total": solo.table.rows, "heads": H, "head_dim": solo.table.dim, "steps": rows}


def _topologies_2gpu(rank):
    """(name, ETP group, across_dp, DP replica of this rank) per case; called once all ranks joined."""
    group = TorchGroup()  # both ranks: the ETP group is the world of 2
    return (("tp2", group, False, 0), ("dp2_across", group, True, rank))


def _nccl_worker(rank, world, tmp, weights_path, topologies=_topologies_2gpu):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # keep NVLink multicast off
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    init_process_group("nccl", rank, world, tmp, device_id=dev)
    result = {"rank": rank, "failures": [], "cases": {}, "device": torch.cuda.get_device_name(dev)}
    try:
        cfg, sds = tiny_text_config(), torch.load(weights_path)
        refs = _build(cfg, sds, dev, None, False)
        static = Static(cfg.hidden_size * cfg.hc_count, dev)
        ref_gstates = _new_states(refs, dev)
        static.fill(_step_inputs(cfg, 0, 0, dev))
        ref_graph, ref_gouts = _capture(lambda: [r(*static.args(i, ref_gstates)) for i, r in enumerate(refs)])
        for name, group, across, dp in topologies(rank):
            t0 = time.perf_counter()
            result["cases"][name] = _topology_case(
                cfg, sds, rank, dev, name, group, across, dp, refs, static, ref_graph, ref_gstates, ref_gouts, result["failures"]
            )
            result["cases"][name]["bench"] = _bench(rank, dev, group, across)
            result["cases"][name]["seconds"] = time.perf_counter() - t0
    except Exception:
        result["failures"].append(traceback.format_exc())
        write_result(tmp, rank, result)
        raise
    dist.barrier()
    dist.destroy_process_group()
    write_result(tmp, rank, result)


def test_nccl_etp_prefetch_in_cuda_graph(tmp_path):
    if not dist.is_nccl_available():
        pytest.skip("NCCL not available")
    cfg = tiny_text_config()
    weights = tmp_path / "weights.pt"
    torch.save([random_ple_state_dict(cfg, i, q, seed=10 + i) for i, q in LAYERS], weights)
    t0 = time.perf_counter()
    results = spawn_workers(_nccl_worker, 2, tmp_path / "run", str(weights), start_method="spawn")
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:40])
    for name, bpt in (("tp2", 2 * 1 * 64 // 2), ("dp2_across", 1 * 4 * 8 + 1 * 64)):  # tiny: 4 heads x d=8
        assert all(r["cases"][name]["bytes_per_token"] == [bpt, bpt] for r in results), name
    # real geometry: 16 heads x 128 bf16 = 4096 B/token; TP2 all-reduce 2*(1/2)*4096; across 16*8 + 4096
    assert results[0]["cases"]["tp2"]["bench"]["steps"][0]["bytes_per_token"] == 4096
    assert results[0]["cases"]["dp2_across"]["bench"]["steps"][0]["bytes_per_token"] == 16 * 8 + 4096
    write_etp_results(
        RESULTS, "tests/test_multi_gpu.py::test_nccl_etp_prefetch_in_cuda_graph", results, t0,
        what_ran="TP2 and DP2-across-dp over NCCL, pinned-host tables, prefetch start+wait+forward in one CUDA graph; "
        "eager and graph outputs/states exact vs the single-GPU reference",
        bytes_note="bytes = per-rank ring volume of the ETP combine (ETPLookup.bytes_per_token x tokens per rank)",
    )


def write_etp_results(path: Path, test: str, results: list[dict], t0: float, what_ran: str, bytes_note: str) -> None:
    """The per-rank figures of a multi-GPU run with machine and versions (``benchmarks/plot_etp.py`` plots them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "test": test,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "devices": [r["device"] for r in results],
        "torch": torch.__version__,
        "nccl": str(torch.cuda.nccl.version()),
        "what_ran": what_ran,
        "bytes_note": bytes_note,
        "seconds": time.perf_counter() - t0,
        "per_rank": [{k: r[k] for k in ("rank", "device", "cases")} for r in results],
    }, indent=1))
