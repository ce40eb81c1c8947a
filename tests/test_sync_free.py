"""A PLE step on the accelerator makes no host sync (issue 29).

Two PLE layers with INT8 tables in pinned host memory (read over UVA), as a model holds them: layer 0's
lookup is started on the prefetch side stream (`PrefetchWorkspace`) before a stand-in for the preceding
decoder layer and joined by its forward, with a hot-row cache that counts the traffic; layer 1 looks up in
place. Every step runs under `torch.cuda.set_sync_debug_mode("error")`: hash, gather + dequant from the host
table, hot-row counting, ETP (one rank), projections, short conv and both state writes. Kernels are compiled
and buffers allocated by a warm-up of the same step shapes outside the mode, and the step inputs are staged
on the device before it (building them, e.g. `PLEBatch.from_lengths`, copies from pageable host memory: a
sync, the caller's, not the PLE path's). The hot-row refresh syncs by design (`ple.hot_rows`), so it runs
between sync-free regions; the steps after it read cache hits. The outputs and states are then compared
with the same layers on the CPU.

The mode catches what PyTorch instruments: `.item()`/`.cpu()`/`int(t)`, `nonzero` and boolean-mask
indexing, blocking copies to or from pageable host memory, `Stream.synchronize()`. It does not catch
`torch.cuda.synchronize()` or `Event.synchronize()` (c10's device/event synchronize do not report to it),
non-blocking copies from pageable memory (host-synchronous in the driver), collectives (torch.distributed),
nor anything outside PyTorch (Triton launches, `cudart().cudaHostRegister`, the caching allocator's
cudaMalloc/cudaFree). `test_an_injected_host_sync_is_caught` checks that the mode does see a sync planted
in the step, on the side stream and on the main stream.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers.configs import EOS, tiny_text_config
from helpers.layers import make_pair
from qwen4_exp_hcu.ple import layer as layer_module
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace

pytestmark = pytest.mark.gpu

SLOTS, HOT_SLOTS = 8, 64
# name: (request lengths, slots, has_initial_state, padding tokens past query_start_loc[-1])
STEPS = {
    # first chunks of three new requests (slot 0's prompt continues in the next step)
    "prefill_1": ([6, 4, 3], [5, 0, 3], [False, False, False], 0),
    # slot 0 continues its chunked prompt, slot 5 decodes, slot 3 sends 2 more tokens, slot 2 is new and
    # long: 1108 tokens x 4 heads > 4096 ids takes torch.sort's segmented (cub) path, not its small sort
    "prefill_2": ([5, 1, 1100, 2], [0, 5, 2, 3], [True, True, False, True], 0),
    # one token per request, a padding request (slot -1) and padding tokens, as CUDA-graph batches have
    "decode": ([1, 1, 1, 1, 1], [0, 5, 2, 3, -1], [True, True, True, True, False], 3),
}
MAX_TOKENS = 1200


@contextlib.contextmanager
def no_host_sync():
    """Every host sync PyTorch instruments raises RuntimeError inside; the mode is restored on the way out."""
    torch.cuda.synchronize()  # the work queued before the region finishes outside it
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # surfaces asynchronous errors of the region's kernels here


def run_step(layers, batch, hs, states, prefetch=None):
    """One model step through the PLE layers; returns each layer's output. With `prefetch`, layer 0's lookup
    starts on the side stream before the work that precedes the layer (a stand-in on the main stream)."""
    outs = []
    for i, (layer, state) in enumerate(zip(layers, states)):
        if i == 0 and prefetch is not None:
            prefetch.start(batch, state)
            x = hs * 1.0  # the preceding decoder layer
            outs.append(layer(x, batch, state, embeddings=prefetch.wait()))
        else:
            outs.append(layer(hs * 1.0, batch, state))
    return outs


class Rig:
    """The two GPU layers (pinned-host INT8 tables) and their CPU twins (same weights), states for both, and
    each step's inputs: on the device for the GPU layers, on the CPU for the twins."""

    def __init__(self):
        cfg = tiny_text_config()
        self.C = cfg.hidden_size * cfg.hc_count
        self.layers = [
            make_pair(cfg, ple_index=i, quantized=True, device="cuda", host=True)[1].to(torch.bfloat16)
            for i in (0, 1)
        ]
        self.refs = [make_pair(cfg, ple_index=i, quantized=True)[1].to(torch.bfloat16) for i in (0, 1)]
        assert all(layer.table.weight.is_pinned() for layer in self.layers)
        self.heads = self.layers[0].spec.num_heads
        t = self.layers[0].table
        row_bytes = t.weight[:1].nbytes + t.scale[:1].nbytes
        budget = HotRows.bytes_needed(t.end - t.start, HOT_SLOTS, row_bytes, observe=True)
        self.hot = self.layers[0].enable_hot_rows(budget)  # no calibration tokens: follows the traffic
        assert self.hot.counts is not None and self.hot.rows.shape[0] == HOT_SLOTS
        self.hot.refresh_every = 10**9  # refreshes run where the tests call them, outside the sync-free regions
        self.prefetch = PrefetchWorkspace(self.layers[:1], MAX_TOKENS, "cuda").handles[0]
        g = torch.Generator().manual_seed(0)
        self.cpu_inputs, self.gpu_inputs = {}, {}
        for name, (lens, slots, init, pad) in STEPS.items():
            T = sum(lens) + pad
            ids = torch.randint(0, 97, (T,), generator=g)
            ids[T // 2] = EOS
            hs = torch.randn(T, self.C, generator=g).to(torch.bfloat16)
            self.cpu_inputs[name] = (PLEBatch.from_lengths(ids, lens, slots, init), hs)
            # staged before any sync-free region: from_lengths copies from pageable host memory
            self.gpu_inputs[name] = (PLEBatch.from_lengths(ids.cuda(), lens, slots, init), hs.cuda())
        self.reset()
        for name in STEPS:  # warm-up: every kernel compiled, cuBLAS and the hash constants set up
            self.step(name)
        torch.cuda.synchronize()
        self.reset()

    def reset(self):
        """Fresh states everywhere and no counted traffic."""
        self.states = [PLEState.zeros(l.state_shapes(), SLOTS, torch.bfloat16, "cuda") for l in self.layers]
        self.ref_states = [PLEState.zeros(l.state_shapes(), SLOTS, torch.bfloat16) for l in self.refs]
        self.hot.counts.zero_()
        self.outputs = []  # (step name, GPU outputs) of the steps run since

    def step(self, name):
        batch, hs = self.gpu_inputs[name]
        outs = run_step(self.layers, batch, hs, self.states, self.prefetch)
        self.outputs.append((name, outs))
        return outs

    def lookups(self) -> int:
        """Row ids layer 0 looked up in the steps run since the last reset (what its cache counted)."""
        return sum(self.gpu_inputs[name][0].num_tokens for name, _ in self.outputs) * self.heads

    def check_against_cpu(self):
        """Replay the steps run since the last reset on the CPU twins: same outputs (bf16 tolerance), same states."""
        for name, outs in self.outputs:
            batch, hs = self.cpu_inputs[name]
            want = run_step(self.refs, batch, hs, self.ref_states)
            n = int(batch.query_start_loc[-1])  # padding tokens are computed, never compared or stored
            for got, ref in zip(outs, want):
                torch.testing.assert_close(got[:n].cpu(), ref[:n], atol=2e-2, rtol=2e-2)
        for got, ref in zip(self.states, self.ref_states):
            assert torch.equal(got.ngram.cpu(), ref.ngram)
            torch.testing.assert_close(got.conv.cpu(), ref.conv, atol=2e-2, rtol=2e-2)


@pytest.fixture
def rig():
    torch.cuda.set_sync_debug_mode("default")
    return Rig()


def test_chunked_prefill_steps_make_no_host_sync(rig):
    with no_host_sync():
        rig.step("prefill_1")
        rig.step("prefill_2")  # requests continuing from their previous chunk, mixed with new ones
    assert int(rig.hot.counts.sum()) == rig.lookups()  # the cache counted every lookup inside the region
    rig.check_against_cpu()


def test_decode_steps_make_no_host_sync(rig):
    rig.step("prefill_1")
    rig.step("prefill_2")
    with no_host_sync():
        for _ in range(3):
            rig.step("decode")
    assert int(rig.hot.counts.sum()) == rig.lookups()
    share = rig.hot.refresh(rig.hot.counts[:-1])  # syncs by design: outside the region
    assert rig.hot.filled == HOT_SLOTS and share > 0
    with no_host_sync():
        for _ in range(2):
            rig.step("decode")  # layer 0's lookups now hit the cache
    rig.check_against_cpu()


INJECTED = {
    "item": lambda t: t.max().item(),
    "cpu": lambda t: t.cpu(),
    "pageable_copy": lambda t: torch.ones(4, dtype=t.dtype).to(t.device),
    "bool_mask": lambda t: t[t >= 0],
}
# where: (module attribute the step calls, the argument handed to the injected sync)
WHERE = {
    "lookup": ("ngram_ids", lambda args: args[1]),  # ngram_ids(spec, input_ids, ...): layer 0's on the side stream
    "state_write": ("write_window", lambda args: args[1].slot_ids),  # write_window(state, batch, ...): main stream
}


@pytest.mark.parametrize("where", sorted(WHERE))
@pytest.mark.parametrize("sync", sorted(INJECTED))
def test_an_injected_host_sync_is_caught(rig, monkeypatch, where, sync):
    """The same step passes clean and raises once a host sync is planted in the PLE path: the mode sees the
    syncs this file claims are absent."""
    with no_host_sync():
        rig.step("decode")
    name, arg = WHERE[where]
    original = getattr(layer_module, name)

    def with_sync(*args, **kwargs):
        INJECTED[sync](arg(args))
        return original(*args, **kwargs)

    monkeypatch.setattr(layer_module, name, with_sync)
    with pytest.raises(RuntimeError, match="synchroniz"):
        with no_host_sync():
            rig.step("decode")
    assert torch.cuda.get_sync_debug_mode() == 0  # restored by the region, also on an error
    rig.step("decode")  # outside the region the planted sync is harmless
