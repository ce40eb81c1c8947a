"""The NCCL worker that the 2- and 4-GPU tests (``test_multi_gpu.py``, ``test_multi_gpu_4.py``) share.

One process per GPU (``cuda:{rank}``), tables in pinned host memory. Per topology (`Topology`, from the
test's `topologies(rank)`): eager steps with prefetch off/on and max_tokens not passed/exact, every output
and state bit for bit vs the single-GPU reference; then `Prefetch.start` + `wait` + `forward` of both PLE
layers captured in one CUDA graph and replayed over all steps with new inputs, bit for bit vs the
reference graph (and the eager reference lookup; forward within 1e-5 of eager). Lookup timings with the
real head geometry are ``benchmarks/bench_etp.py``'s.
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.common import capture, time_ms
from helpers.configs import tiny_text_config
from helpers.dist import Topology, compare_steps, init_process_group, max_abs_diff, spawn_workers, write_result
from helpers.layers import load_state_dicts, ple_state_dict, save_state_dicts
from helpers.steps import schedule_step
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.etp import ETPLookup
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace
from qwen4_exp_hcu.ple.storage import PLEStorage

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
REAL_HEADS, REAL_HEAD_DIM = 16, 128  # the releases' PLE head geometry, for the bytes per token at scale


def _build_gpu(cfg, sds, dev, group, across, replica=None):
    return [
        PLELayer.from_state_dict(
            cfg, i, sd, dtype=torch.float32, storage=PLEStorage(
                "int8" if q else "bf16", dev, host=True, etp_group=group, across_dp=across, replica_group=replica
            ),
        )
        for (i, q), sd in zip(NCCL_LAYERS, sds)
    ]


def _new_states(layers, dev) -> list[PLEState]:
    return [PLEState.zeros(layer.state_shapes(), NCCL_SLOTS, torch.float32, dev) for layer in layers]


def _zero(states):
    for s in states:
        s.ngram.zero_()
        s.conv.zero_()


def _eager_steps(cfg, layers, states, dp, dev, prefetch, max_tokens_mode, ws):
    """Real (uneven) shapes, no graph: [(outputs, states)] per step."""
    record = []
    for step in range(NCCL_NSTEPS):
        batch, hs = schedule_step(cfg, NCCL_SCHEDULES, dp, step, len(NCCL_LAYERS), dev)
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
    at_scale = ETPLookup(1 << 20, REAL_HEAD_DIM, PLEStorage(device="meta", etp_group=topo.group, across_dp=topo.across_dp, replica_group=topo.replica))
    info = {"dp": topo.dp, "rows": [[l.table.start, l.table.end] for l in layers],
            "bytes_per_token": [l.etp.bytes_per_token(l.spec.num_heads) for l in layers],
            "bytes_per_token_real_geometry": at_scale.bytes_per_token(REAL_HEADS)}  # fmt: skip

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

    static.fill(schedule_step(cfg, NCCL_SCHEDULES, topo.dp, 0, len(NCCL_LAYERS), dev))
    graph, outs = capture(body)
    _zero(states)
    _zero(w.ref_states)
    eager_states = _new_states(refs, dev)
    bitwise_vs_eager, max_vs_eager = True, 0.0
    for step in range(NCCL_NSTEPS):
        T = static.fill(schedule_step(cfg, NCCL_SCHEDULES, topo.dp, step, len(NCCL_LAYERS), dev))
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
        "replay_ms_etp_prefetch": time_ms(graph.replay, 50),
        "replay_ms_single_gpu_reference": time_ms(w.ref_graph.replay, 50),
    }
    return info


def nccl_worker(rank, world, tmp, weights_path, topologies):
    """One rank of an NCCL test: every `Topology` of `topologies(rank)` (called once all ranks joined, so
    it may create subgroups), then `write_result`."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # keep NVLink multicast off
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    init_process_group("nccl", rank, world, tmp, device_id=dev)
    result = {"rank": rank, "failures": [], "cases": {}, "device": torch.cuda.get_device_name(dev)}
    try:
        cfg, sds = tiny_text_config(), load_state_dicts(weights_path)
        refs = _build_gpu(cfg, sds, dev, None, False)
        static = StaticBatch(cfg.hidden_size * cfg.hc_count, dev)
        ref_states = _new_states(refs, dev)
        static.fill(schedule_step(cfg, NCCL_SCHEDULES, 0, 0, len(NCCL_LAYERS), dev))
        ref_graph, ref_outs = capture(lambda: [r(static.hs[i], static.batch, ref_states[i]) for i, r in enumerate(refs)])
        worker = NcclWorker(cfg, sds, rank, dev, refs, static, ref_graph, ref_states, ref_outs, result["failures"])
        for topo in topologies(rank):
            t0 = time.perf_counter()
            result["cases"][topo.name] = _topology_case(worker, topo)
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
    (pytest ``--results-dir``; nothing is written without it)."""
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
    weights = tmp_path / "weights.safetensors"
    save_state_dicts([ple_state_dict(cfg, i, q, seed=10 + i) for i, q in NCCL_LAYERS], weights)
    t0 = time.perf_counter()
    results = spawn_workers(nccl_worker, world, tmp_path / "run", str(weights), topologies, start_method="spawn")
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:40])
    return results, t0
