"""Helpers for multi-process ETP tests: weights, process groups, starting workers, a byte-counting group,
and the NCCL worker that the 2- and 4-GPU tests (``test_multi_gpu.py``, ``test_multi_gpu_4.py``) share.

Workers are not forked from the test process (its OpenMP/CUDA state must not leak into them): they come
from a forkserver that has imported torch, transformers and the PLE modules once, so each worker starts in
well under a second instead of paying ~6 s of imports (compressed-tensors, transformers). Each worker writes
``rank{r}.json`` into a shared tmp dir, and a dying worker fails the test with its own traceback.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ple_configs import EOS, tiny_text_config
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.etp import Group
from qwen4_exp_hcu.ple.hashing import NgramHashSpec
from qwen4_exp_hcu.ple.int8 import quantize_rows
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace

PG_TIMEOUT_S = 60  # a rank stuck in a collective fails after this instead of hanging the suite
# imported once by the forkserver (it does not get the tests/ folder on sys.path, so only installed modules)
PRELOAD = [
    "torch", "torch.distributed", "pytest", "transformers", "transformers.models.qwen4_exp.configuration_qwen4_exp",
    "qwen4_exp_hcu.ple.layer", "qwen4_exp_hcu.ple.prefetch",
]


def random_ple_state_dict(cfg, ple_index: int, quantized: bool, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors (relative to ``model.layers.{i}.ple.``) of one PLE layer, random values."""
    spec = NgramHashSpec.from_config(cfg, ple_index)
    g = torch.Generator().manual_seed(seed)
    width, embed = cfg.hidden_size * cfg.hc_count, spec.num_heads * spec.head_dim
    K = cfg.ple_conv_kernel_size
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    sd = {
        "key_proj.weight": rnd(width, embed),
        "value_proj.weight": rnd(cfg.hidden_size, embed),
        "norm_key.weight": rnd(width),
        "norm_query.weight": rnd(width),
        "norm_conv.weight": rnd(width),
        "conv1d.weight": rnd(width, 1, K),
    }
    table = torch.randn(spec.rows, spec.head_dim, generator=g).to(torch.bfloat16)
    q, s = quantize_rows(table)
    n = -(-spec.rows // cfg.split_ngram_parts)
    for j in range(cfg.split_ngram_parts):
        rows, name = slice(j * n, (j + 1) * n), f"ple_embedding.ngram_embedding.shard_{j}.weight"
        if quantized:
            sd[name], sd[name + "_scale"] = q[rows].clone(), s[rows].clone()
        else:
            sd[name] = table[rows].clone()
    return sd


def init_process_group(backend: str, rank: int, world: int, tmp: str, device_id=None) -> None:
    """FileStore rendezvous in `tmp` (no ports to race for)."""
    kw = {"device_id": device_id} if device_id is not None else {}
    dist.init_process_group(
        backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S), **kw,
    )


def write_result(tmp: str, rank: int, result: dict) -> None:
    """A worker's result for `spawn_workers` (in the run's tmp dir, not a results file)."""
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def compare_steps(got: list, want: list, label: str, failures: list[str]) -> None:
    """Append a line per differing output / state: steps of (per-layer outputs, per-layer `PLEState`s)."""
    def diff(a, b):
        return f"max|diff| {max_abs_diff(a, b):.3g}" if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"

    for step, ((g_out, g_st), (w_out, w_st)) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(g_out, w_out, strict=True)):
            if not torch.equal(g, w):
                failures.append(f"{label}: step {step} layer {i} output differs ({diff(g, w)})")
            for name, a, b in (("ngram_state", g_st[i].ngram, w_st[i].ngram), ("conv_state", g_st[i].conv, w_st[i].conv)):
                if not torch.equal(a, b):
                    failures.append(f"{label}: step {step} layer {i} {name} differs ({diff(a, b)})")


def spawn_workers(fn, world: int, tmp: Path, *args, start_method: str = "forkserver") -> list[dict]:
    """Run ``fn(rank, world, str(tmp), *args)`` in `world` new processes; return each rank's result.
    A worker that raises (or dies) fails the calling test with the worker's traceback."""
    tmp.mkdir(parents=True, exist_ok=True)
    if start_method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)  # no effect once a forkserver runs (then workers import themselves)
    try:
        mp.start_processes(fn, args=(world, str(tmp), *args), nprocs=world, join=True, start_method=start_method)
    except mp.ProcessRaisedException as e:  # message carries the worker's formatted traceback
        pytest.fail(f"ETP worker raised:\n{e}", pytrace=False)
    except mp.ProcessExitedException as e:
        pytest.fail(f"ETP worker died: {e}", pytrace=False)
    results = []
    for r in range(world):
        f = tmp / f"rank{r}.json"
        if not f.exists():
            pytest.fail(f"ETP worker {r} exited without writing {f.name}")
        results.append(json.loads(f.read_text()))
    return results


class CountingGroup:
    """Wraps a `Group`; adds up the bytes each collective moves per rank under the ring algorithm
    (the volume `ETPLookup.bytes_per_token` describes): all-reduce 2(W-1)/W * n, all-gather (W-1) * n_in,
    reduce-scatter (W-1)/W * n_in."""

    def __init__(self, inner):
        self.inner = inner
        self.world_size, self.rank_in_group = inner.world_size, inner.rank_in_group
        self.bytes, self.calls = 0, []

    def _count(self, kind, x, num):
        self.bytes += num * x.numel() * x.element_size() // self.world_size
        self.calls.append((kind, tuple(x.shape)))

    def all_reduce(self, x):
        self._count("all_reduce", x, 2 * (self.world_size - 1))
        return self.inner.all_reduce(x)

    def all_gather(self, x, dim=-1):
        self._count("all_gather", x, (self.world_size - 1) * self.world_size)
        return self.inner.all_gather(x, dim)

    def reduce_scatter(self, x, dim=-1):
        self._count("reduce_scatter", x, self.world_size - 1)
        return self.inner.reduce_scatter(x, dim)

    def reset(self):
        self.bytes, self.calls = 0, []


@dataclass(frozen=True)
class Topology:
    """One ETP layout as one rank sees it (rank = dp * TP + tp)."""

    name: str  # the case's key in the results
    group: Group | None  # this rank's ETP group; None: every rank its whole table, nothing combined
    across_dp: bool  # embedding_across_dp: the group's ranks hold different tokens
    dp: int  # the DP replica whose tokens (schedule) this rank runs
    replica: Group | None = None  # across DP: the ranks of this rank's replica (its TP group)


# ---- the NCCL worker of test_multi_gpu.py (2 GPUs) and test_multi_gpu_4.py (4 GPUs) ------------------
# One process per GPU (``cuda:{rank}``), tables in pinned host memory. Per topology (`Topology`, from the
# test's `topologies(rank)`): eager steps with prefetch off/on and max_tokens not passed/exact, every output
# and state bit for bit vs the single-GPU reference; then `Prefetch.start` + `wait` + `forward` of both PLE
# layers captured in one CUDA graph and replayed over all steps with new inputs, bit for bit vs the
# reference graph (and the eager reference lookup; forward within 1e-5 of eager); then a lookup-only
# benchmark with the real head geometry.
NCCL_CAP = 16  # static token count of the graph = workspace capacity
NCCL_B_STATIC = 4  # static request count; unused ones are padding requests (slot -1, no tokens)
NCCL_SLOTS = 8
NCCL_LAYERS = ((0, True), (1, False))  # (ple_layer_index, INT8 table?)
_PAD = (-1, 0, True)
# per DP replica, per step: (slot, tokens, has_initial_state); each replica: prefill, then decode steps
NCCL_SCHEDULES = (
    ([(3, 9, False), (0, 4, False)], [(3, 1, True), (0, 1, True)], [(3, 1, True), (0, 1, True)], [_PAD]),
    ([(1, 2, False)], [(1, 1, True), (5, 6, False)], [(1, 1, True), (5, 1, True)], [(5, 1, True), (6, 3, False)]),
)
NCCL_NSTEPS = len(NCCL_SCHEDULES[0])
NCCL_MAX_T = [max(sum(n for _, n, _ in s[step]) for s in NCCL_SCHEDULES) for step in range(NCCL_NSTEPS)]
BENCH_TOKENS = (64, 256, 2048)
BENCH_ITERS = 20


def _build_gpu(cfg, sds, dev, group, across, replica=None):
    return [
        PLELayer.from_state_dict(
            cfg, i, sd, table_format="int8" if q else "bf16", dtype=torch.float32, device=dev, host_table=True, etp_group=group, across_dp=across,
            replica_group=replica,
        )
        for (i, q), sd in zip(NCCL_LAYERS, sds)
    ]


def _new_states(layers, dev) -> list[PLEState]:
    return [PLEState.zeros(layer.state_shapes(), NCCL_SLOTS, torch.float32, dev) for layer in layers]


def _zero(states):
    for s in states:
        s.ngram.zero_()
        s.conv.zero_()


def _gpu_step_inputs(cfg, dp, step, dev) -> tuple[PLEBatch, list[torch.Tensor]]:
    """Step `step` of replica `dp` at its real shapes: the batch and each layer's hidden states."""
    reqs = NCCL_SCHEDULES[dp][step]
    g = torch.Generator().manual_seed(100 * dp + step)
    T = sum(n for _, n, _ in reqs)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    if (dp, step) == (0, 0):
        ids[3] = EOS
    C = cfg.hidden_size * cfg.hc_count
    hs = [torch.randn(T, C, generator=g).to(dev) for _ in NCCL_LAYERS]
    batch = PLEBatch.from_lengths(ids.to(dev), [n for _, n, _ in reqs], [s for s, _, _ in reqs], [h for _, _, h in reqs])
    return batch, hs


def _eager_steps(cfg, layers, states, dp, dev, prefetch, max_tokens_mode, ws):
    """Real (uneven) shapes, no graph: [(outputs, states)] per step."""
    record = []
    for step in range(NCCL_NSTEPS):
        batch, hs = _gpu_step_inputs(cfg, dp, step, dev)
        batch = replace(batch, max_tokens=NCCL_MAX_T[step] if max_tokens_mode == "exact" else None)
        if prefetch:
            for handle, state in zip(ws.handles, states):
                handle.start(batch, state)
        outs = [
            layer(hs[i], batch, states[i], embeddings=ws.handles[i].wait() if prefetch else None)
            for i, layer in enumerate(layers)
        ]
        record.append(([o.clone() for o in outs], [s.clone() for s in states]))
    return record


class StaticBatch:
    """Persistent graph inputs; `fill` copies a real batch in and pads it to NCCL_CAP tokens / NCCL_B_STATIC
    requests. `batch` wraps the static tensors themselves (what a captured graph reads)."""

    def __init__(self, C, dev):
        self.ids = torch.zeros(NCCL_CAP, dtype=torch.int64, device=dev)
        self.qsl = torch.zeros(NCCL_B_STATIC + 1, dtype=torch.int32, device=dev)
        self.slots = torch.full((NCCL_B_STATIC,), -1, dtype=torch.int64, device=dev)
        self.init = torch.ones(NCCL_B_STATIC, dtype=torch.bool, device=dev)
        self.batch = PLEBatch(self.ids, self.qsl, self.slots, self.init)
        self.hs = [torch.zeros(NCCL_CAP, C, device=dev) for _ in NCCL_LAYERS]
        self.busy, self.busy_out = torch.randn(1024, 1024, device=dev), torch.empty(1024, 1024, device=dev)

    def fill(self, inputs: tuple[PLEBatch, list[torch.Tensor]]) -> int:
        batch, hs = inputs
        T, B = batch.num_tokens, batch.num_requests
        assert T <= NCCL_CAP and B < NCCL_B_STATIC, "a trailing padding request must own the padding tokens"
        self.ids.zero_()
        self.ids[:T].copy_(batch.input_ids)
        self.qsl.fill_(T)
        self.qsl[: B + 1].copy_(batch.query_start_loc)
        self.slots.fill_(-1)
        self.slots[:B].copy_(batch.slot_ids)
        self.init.fill_(True)
        self.init[:B].copy_(batch.has_initial_state)
        for h, src in zip(self.hs, hs):
            h.zero_()
            h[:T].copy_(src)
        return T


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


@dataclass
class NcclWorker:
    """What every topology case of one NCCL worker shares: config, weights, its device, the single-GPU
    reference layers with their graph captured over the static batch, and the failure list."""

    cfg: object
    sds: list[dict]
    rank: int
    dev: torch.device
    refs: list[PLELayer]
    static: StaticBatch
    ref_graph: torch.cuda.CUDAGraph
    ref_states: list[PLEState]  # the reference graph's state
    ref_outs: list[torch.Tensor]  # the reference graph's outputs
    failures: list[str]


def _topology_case(w: NcclWorker, topo: Topology) -> dict:
    cfg, dev, refs, static, failures = w.cfg, w.dev, w.refs, w.static, w.failures
    layers = _build_gpu(cfg, w.sds, dev, topo.group, topo.across_dp, topo.replica)
    assert all(l.table.weight.is_pinned() for l in layers), "tables must be in pinned host memory"
    ws = PrefetchWorkspace(layers, NCCL_CAP, dev)
    info = {"dp": topo.dp, "rows": [[l.table.start, l.table.end] for l in layers],
            "bytes_per_token": [l.etp.bytes_per_token(l.spec.num_heads) for l in layers]}  # fmt: skip

    # 1. eager, real uneven shapes, vs the single-GPU reference at the same shapes
    want = _eager_steps(cfg, refs, _new_states(refs, dev), topo.dp, dev, False, None, None)
    for prefetch in (False, True):
        for mode in (None, "exact"):
            got = _eager_steps(cfg, layers, _new_states(layers, dev), topo.dp, dev, prefetch, mode, ws)
            compare_steps(got, want, f"{topo.name} eager prefetch={prefetch} max_tokens={mode}", failures)

    # 2. one CUDA graph: prefetch start (side stream, NCCL inside) + wait + forward of both layers
    states = _new_states(layers, dev)
    graph_batch = replace(static.batch, max_tokens=NCCL_CAP)  # the static tensors, not copies

    def body():
        for handle, state in zip(ws.handles, states):
            handle.start(graph_batch, state)
        torch.mm(static.busy, static.busy, out=static.busy_out)  # the preceding decoder layer's work, main stream
        return [layer(static.hs[i], graph_batch, states[i], embeddings=ws.handles[i].wait()) for i, layer in enumerate(layers)]

    static.fill(_gpu_step_inputs(cfg, topo.dp, 0, dev))
    graph, outs = _capture(body)
    _zero(states)
    _zero(w.ref_states)
    eager_states = _new_states(refs, dev)
    bitwise_vs_eager, max_vs_eager = True, 0.0
    for step in range(NCCL_NSTEPS):
        T = static.fill(_gpu_step_inputs(cfg, topo.dp, step, dev))
        want_emb = [r.lookup(static.batch, eager_states[i]) for i, r in enumerate(refs)]
        graph.replay()
        w.ref_graph.replay()
        eager = [r(static.hs[i], static.batch, eager_states[i]) for i, r in enumerate(refs)]
        torch.cuda.synchronize()
        label = f"{topo.name} graph step {step}"
        for i in range(len(layers)):
            if not torch.equal(ws.handles[i].buffer[:NCCL_CAP], want_emb[i]):
                failures.append(f"{label} layer {i}: prefetched embeddings differ from the reference lookup")
            if not torch.equal(outs[i], w.ref_outs[i]):
                failures.append(f"{label} layer {i}: output differs from the captured reference (max|diff| {max_abs_diff(outs[i], w.ref_outs[i]):.3g})")
            for what, a, b in (("ngram_state", states[i].ngram, w.ref_states[i].ngram), ("conv_state", states[i].conv, w.ref_states[i].conv)):
                if not torch.equal(a, b):
                    failures.append(f"{label} layer {i}: {what} differs from the captured reference")
            if not torch.equal(states[i].ngram, eager_states[i].ngram):
                failures.append(f"{label} layer {i}: ngram_state differs from the eager reference")
            for a, b in ((outs[i][:T], eager[i][:T]), (states[i].conv, eager_states[i].conv)):
                d = max_abs_diff(a, b)
                max_vs_eager = max(max_vs_eager, d)
                bitwise_vs_eager &= torch.equal(a, b)
                if not d <= 1e-5:
                    failures.append(f"{label} layer {i}: graph vs eager reference max|diff| {d:.3g} > 1e-5")
    info["graph_bitwise_vs_eager_reference"] = bitwise_vs_eager
    info["graph_max_diff_vs_eager_reference"] = max_vs_eager

    # 3. per-step figures of the tiny layers: ETP bytes (static batch of NCCL_CAP tokens) and replay times
    dist.barrier()
    info["graph_step"] = {
        "tokens_per_rank": NCCL_CAP,
        "etp_bytes_per_rank": sum(b * NCCL_CAP for b in info["bytes_per_token"]),
        "replay_ms_etp_prefetch": _time_ms(graph.replay, 50),
        "replay_ms_single_gpu_reference": _time_ms(w.ref_graph.replay, 50),
    }
    return info


def _bench(rank, dev, topo: Topology):
    """Lookup only, real head geometry (16 heads x d=128, INT8 rows + bf16 scale, pinned host table):
    eager ETP lookup vs the single-GPU lookup, and the prefetch start+wait replayed from a CUDA graph."""
    cfg = tiny_text_config(
        ngram_size=3, heads_per_ngram=8, ple_embed_dim=16 * 128, ngram_vocab_size_base=200_003,
        make_ngram_vocab_size_divisible_by=128, split_ngram_parts=16, vocab_size=248_320,
    )
    etp = PLELayer(
        cfg, 0, table_format="int8", device=dev, host_table=True, etp_group=topo.group, across_dp=topo.across_dp,
        replica_group=topo.replica,
    )
    solo = PLELayer(cfg, 0, table_format="int8", device=dev, host_table=True)
    full = torch.randint(-127, 127, (solo.table.rows, solo.table.dim), dtype=torch.int8, device=dev, generator=torch.Generator(dev).manual_seed(0))
    solo.table.weight.copy_(full)
    etp.table.weight.copy_(full[etp.table.start : etp.table.end])
    for t in (solo.table, etp.table):
        t.scale.fill_(0.01)
    del full
    state = PLEState.zeros(solo.state_shapes(), 1, torch.bfloat16, dev)  # one slot; lookup reads its n-gram context
    H, rows = solo.spec.num_heads, []
    for T in BENCH_TOKENS:
        seed = 1000 + T + (topo.dp if topo.across_dp else 0)  # the TP ranks of one replica: the same tokens
        ids = torch.randint(0, cfg.vocab_size, (T,), device=dev, generator=torch.Generator(dev).manual_seed(seed))
        batch = PLEBatch(ids, torch.tensor([0, T], dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int64, device=dev),
                         torch.zeros(1, dtype=torch.bool, device=dev))  # fmt: skip
        bounded = replace(batch, max_tokens=T)
        assert torch.equal(etp.lookup(bounded, state), solo.lookup(batch, state))
        ws = PrefetchWorkspace([etp], T, dev)

        def prefetch(handle=ws.handles[0]):
            handle.start(bounded, state)
            return handle.wait()

        graph, _ = _capture(prefetch)
        dist.barrier()
        rows.append({
            "tokens_per_rank": T,
            "bytes_per_token": etp.etp.bytes_per_token(H),
            "etp_bytes_per_rank": etp.etp.combine_bytes(H, T),
            "table_rows_owned": etp.table.end - etp.table.start,
            "lookup_ms_etp_eager": _time_ms(lambda: etp.lookup(bounded, state), BENCH_ITERS),
            "lookup_ms_single_gpu_eager": _time_ms(lambda: solo.lookup(batch, state), BENCH_ITERS),
            "prefetch_ms_etp_graph": _time_ms(graph.replay, BENCH_ITERS),
        })
        del graph, ws, prefetch
    return {"rows_total": solo.table.rows, "heads": H, "head_dim": solo.table.dim, "steps": rows}


def nccl_worker(rank, world, tmp, weights_path, topologies):
    """One rank of an NCCL test: every `Topology` of `topologies(rank)` (called once all ranks joined, so
    it may create subgroups), then `write_result`."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # keep NVLink multicast off
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    init_process_group("nccl", rank, world, tmp, device_id=dev)
    result = {"rank": rank, "failures": [], "cases": {}, "device": torch.cuda.get_device_name(dev)}
    try:
        cfg, sds = tiny_text_config(), torch.load(weights_path)
        refs = _build_gpu(cfg, sds, dev, None, False)
        static = StaticBatch(cfg.hidden_size * cfg.hc_count, dev)
        ref_states = _new_states(refs, dev)
        static.fill(_gpu_step_inputs(cfg, 0, 0, dev))
        ref_graph, ref_outs = _capture(lambda: [r(static.hs[i], static.batch, ref_states[i]) for i, r in enumerate(refs)])
        worker = NcclWorker(cfg, sds, rank, dev, refs, static, ref_graph, ref_states, ref_outs, result["failures"])
        for topo in topologies(rank):
            t0 = time.perf_counter()
            result["cases"][topo.name] = _topology_case(worker, topo)
            result["cases"][topo.name]["bench"] = _bench(rank, dev, topo)
            result["cases"][topo.name]["seconds"] = time.perf_counter() - t0
    except Exception:
        result["failures"].append(traceback.format_exc())
        write_result(tmp, rank, result)
        raise
    dist.barrier()
    dist.destroy_process_group()
    write_result(tmp, rank, result)


def write_etp_results(
    results_dir: Path | None, filename: str, test: str, results: list[dict], t0: float, what_ran: str, bytes_note: str
) -> None:
    """The per-rank figures of a multi-GPU run with machine and versions, as `results_dir/filename`
    (pytest ``--results-dir``; nothing is written without it). ``benchmarks/plot_etp.py`` plots them."""
    if results_dir is None:
        return
    path = Path(results_dir) / filename
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


def run_nccl_workers(tmp_path: Path, world: int, topologies) -> tuple[list[dict], float]:
    """Spawn `nccl_worker` on `world` GPUs over the tiny config's PLE layers; fail on any mismatch.
    Returns the per-rank results and the start time."""
    if not dist.is_nccl_available():
        pytest.skip("NCCL not available")
    cfg = tiny_text_config()
    weights = tmp_path / "weights.pt"
    torch.save([random_ple_state_dict(cfg, i, q, seed=10 + i) for i, q in NCCL_LAYERS], weights)
    t0 = time.perf_counter()
    results = spawn_workers(nccl_worker, world, tmp_path / "run", str(weights), topologies, start_method="spawn")
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:40])
    return results, t0
