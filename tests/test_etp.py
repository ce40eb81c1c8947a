"""ETP / cross-DP lookup on CPU: multi-process gloo (world sizes 2 and 4) against the single-process layer.

Topologies (rank = dp * TP + tp):
* world 2: TP2 (one ETP group, same tokens), DP2 without ``embedding_across_dp`` (no group, each rank its
  full table), DP2 with it (one ETP group of the 2 DP ranks, different tokens);
* world 4: TP2 x DP2 without it (two ETP groups = the TP pairs, made with ``new_group``), and with it (one
  ETP group of all 4; ranks of one DP replica hold the same tokens).
Each runs prefill + decode steps with uneven token counts per DP rank (including ranks with zero tokens
and a step where every rank has none), with prefetch off (``PLELayer.forward``) and on
(``PrefetchWorkspace.handles[i].start``/``wait`` -> ``forward(embeddings=...)``), with the batch's
``max_tokens`` not set, set exactly, and padded to the workspace capacity. Every output and every state
tensor after every step must equal, bit for bit, the single-process reference (a ``PLELayer`` with group
None over the same weights): each table row is owned by exactly one rank, so the bf16 sum adds a value to
zeros (exact), and everything downstream runs the same ops on the same shapes in the same process. No
tolerance is needed.

Workers run every case inside one spawn per world size (process start + imports dominate the time).
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from helpers.configs import EOS, tiny_text_config
from helpers.dist import CountingGroup, Topology, compare_steps, init_process_group, spawn_workers, write_result
from helpers.faults import double_last_ranks_rows
from helpers.layers import load_state_dicts, ple_state_dict, save_state_dicts
from helpers.steps import schedule_step
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.etp import ETPLookup, TorchGroup
from qwen4_exp_hcu.ple.storage import PLEStorage, owned_rows
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace
from qwen4_exp_hcu.kernels.gather_dequant import BF16, gather_dequant_reference
from qwen4_exp_hcu.ple.table import PLETable

CAP = 12  # prefetch workspace capacity (max_num_batched_tokens)
SLOTS = 4
LAYERS = ((0, True), (1, False))  # (ple_layer_index, INT8 table?): one INT8 and one BF16 table
PAD = (-1, 0, True)  # a padding request with no tokens: a DP rank with no work this step (T = 0)
# Per DP replica, per step: requests (slot, tokens, has_initial_state). Replica 0: prefill of 2 requests +
# 2 decode steps (one with a padding request holding a token), then idle; replica 1: idle, prefill, 2 decodes.
SCHEDULES = (
    ([(3, 7, False), (0, 2, False)], [(3, 1, True), (0, 1, True)], [(3, 1, True), (0, 1, True), (-1, 1, True)], [PAD], [PAD]),
    ([PAD], [(1, 4, False), (2, 3, False)], [(1, 1, True), (2, 1, True)], [(1, 1, True)], [PAD]),
)
FIRST_PREFILL = (0, 1)  # step of each replica whose requests are all new
NSTEPS = len(SCHEDULES[0])
TOKENS = [[sum(n for _, n, _ in steps[s]) for s in range(NSTEPS)] for steps in SCHEDULES]  # [[9,2,3,0,0],[0,7,2,1,0]]
MAX_T = [max(t[s] for t in TOKENS) for s in range(NSTEPS)]
MT_MODES = (None, "exact", "padded")  # max_tokens: not passed / max over the DP ranks / workspace capacity

# The tiny config has H = (3-1)*2 = 4 heads of d = 8: one token's embedding is 4*8 bf16 = 64 B, its row
# ids 4 int64 = 32 B. Per-rank ring volume per token: all-reduce 2(W-1)/W * 64; across DP, per token of the
# replica (each of its TP ranks sends a 1/TP slice): ((W-1)*(32 + 64) + (TP-1)*64) / TP.
HEADS, HEAD_DIM = 4, 8
HAND_BYTES_PER_TOKEN = {
    "tp2": 2 * 1 * 64 // 2,  # 64
    "dp2": 0,  # no group: nothing moves
    "dp2_across": 1 * 32 + 1 * 64,  # 96
    "tp2xdp2": 2 * 1 * 64 // 2,  # 64 (within each TP pair)
    "tp2xdp2_across": (3 * (32 + 64) + 64) // 2,  # 176 (288 when every TP rank sent every token)
}
CASES = {2: ("tp2", "dp2", "dp2_across"), 4: ("tp2xdp2", "tp2xdp2_across")}


# ---- worker side ---------------------------------------------------------------------------------
def _build(cfg, sds, group, across, replica=None):
    return [
        PLELayer.from_state_dict(
            cfg, i, sd, dtype=torch.float32,
            storage=PLEStorage("int8" if q else "bf16", etp_group=group, across_dp=across, replica_group=replica),
        )
        for (i, q), sd in zip(LAYERS, sds)
    ]


def _run_steps(cfg, layers, dp, prefetch, mt_mode):
    """All steps of replica `dp` from empty state: [(outputs per layer, `PLEState` per layer)]."""
    states = [PLEState.zeros(layer.state_shapes(), SLOTS, torch.float32) for layer in layers]
    ws = PrefetchWorkspace(layers, CAP, "cpu") if prefetch else None
    record = []
    for step in range(NSTEPS):
        batch, hs = schedule_step(cfg, SCHEDULES, dp, step, len(LAYERS))
        batch = replace(batch, max_tokens={None: None, "exact": MAX_T[step], "padded": CAP}[mt_mode])
        if prefetch:  # all lookups issued first, as before the preceding decoder layers
            for handle, state in zip(ws.handles, states):
                handle.start(batch, state)
        outs = []
        for i, layer in enumerate(layers):
            emb = ws.handles[i].wait() if prefetch else None  # None: forward looks up (with batch.max_tokens)
            outs.append(layer(hs[i], batch, states[i], embeddings=emb))
        record.append((outs, [s.clone() for s in states]))
    return record


def _expected_bytes(layer, dp, mt_mode):
    """Bytes the ETP combine of one layer moves over all steps, from `combine_bytes`."""
    g = layer.etp.group
    if g is None:
        return 0
    total = 0
    for step in range(NSTEPS):
        if not layer.etp.across_dp:
            total += layer.etp.combine_bytes(HEADS, TOKENS[dp][step])
        else:
            mt = {None: MAX_T[step], "exact": MAX_T[step], "padded": CAP}[mt_mode]
            total += layer.etp.combine_bytes(HEADS, mt) + (8 * (g.world_size - 1) if mt_mode is None else 0)  # + count exchange
    return total


def _topologies(rank, world):
    if world == 2:
        everyone = TorchGroup()
        return [Topology("tp2", everyone, False, 0), Topology("dp2", None, False, rank), Topology("dp2_across", everyone, True, rank)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every subgroup, same order
    pair = TorchGroup(pairs[rank // 2])
    return [
        Topology("tp2xdp2", pair, False, rank // 2),
        Topology("tp2xdp2_across", TorchGroup(), True, rank // 2, replica=pair),
    ]


def _capacity_error_case(cfg, layers, rank, counting, failures):
    """A DP rank with more tokens than the workspace holds: with max_tokens passed, every rank raises at
    start() before any collective (so none is left waiting in one)."""
    ws = PrefetchWorkspace(layers, CAP, "cpu")
    T = CAP + 1 if rank == 0 else 1
    batch = PLEBatch.from_lengths(torch.randint(0, cfg.vocab_size, (T,)), [T], [0], [False])
    state = PLEState.zeros(layers[0].state_shapes(), SLOTS, torch.float32)
    calls = len(counting.calls)
    try:
        ws.handles[0].start(replace(batch, max_tokens=CAP + 1), state)
        failures.append(f"rank {rank}: start() with max_tokens={CAP + 1} > capacity {CAP} did not raise")
    except ValueError as e:
        if "capacity" not in str(e):
            failures.append(f"rank {rank}: capacity error does not say so: {e}")
    if len(counting.calls) != calls:
        failures.append(f"rank {rank}: capacity error after a collective: {counting.calls[calls:]}")
    # without max_tokens the ranks exchange counts first, then every rank raises (none is left waiting)
    try:
        ws.handles[0].start(batch, state)
        failures.append(f"rank {rank}: start() without max_tokens did not raise although rank 0 is over capacity")
    except ValueError as e:
        if "capacity" not in str(e):
            failures.append(f"rank {rank}: capacity error does not say so: {e}")


def _empty_batch_lookup(cfg, layers, refs, dp, label, failures):
    """lookup() of a rank with no requests at all (B = 0, T = 0) beside a rank with tokens."""
    T = 3 if dp == 0 else 0
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(7))
    batch = PLEBatch.from_lengths(ids, [T] if T else [], [0] if T else [], [False] if T else [])
    state = PLEState.zeros(layers[0].state_shapes(), SLOTS, torch.float32)
    got, want = layers[0].lookup(batch, state), refs[0].lookup(batch, state)
    if not torch.equal(got, want):
        failures.append(f"{label}: lookup with an empty batch on DP rank 1 differs")


def _rows_fewer_than_ranks(rank, world, failures):
    """A 3-row table over an ETP group of 4: rank 3 owns no rows and must still take part. Returns the row
    range of the table ETPLookup built, per across_dp."""
    group = TorchGroup()
    full = torch.randn(3, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ranges = []
    for across in (False, True):
        etp = ETPLookup(3, 4, PLEStorage("bf16", etp_group=group, across_dp=across))
        ranges.append([etp.table.start, etp.table.end])
        etp.table.load_shard(0, full)
        etp.table.check_loaded()
        n = [2, 1, 3, 0][rank] if across else 3
        ids = torch.randint(0, 3, (n, 2), generator=torch.Generator().manual_seed(rank if across else 0))
        got = etp(ids)
        if not torch.equal(got, gather_dequant_reference(ids, full, None, 0, kind=BF16)):
            failures.append(f"rows < ranks, across_dp={across}: rank {rank} lookup differs")
    return ranges


def _etp_worker(rank, world, tmp, weights_path, fault=False):
    torch.set_num_threads(1)  # 2-4 processes on 2 cores
    t0 = time.perf_counter()
    if fault:
        double_last_ranks_rows()
    init_process_group("gloo", rank, world, tmp)
    cfg, sds = tiny_text_config(), load_state_dicts(weights_path)
    result = {"rank": rank, "failures": [], "cases": {}}
    failures = result["failures"]
    refs = _build(cfg, sds, None, False)
    ref_runs = {dp: _run_steps(cfg, refs, dp, False, None) for dp in range(len(SCHEDULES))}
    for topo in _topologies(rank, world):
        name, group, dp = topo.name, topo.group, topo.dp
        counting = CountingGroup(group) if group is not None else None
        replica = CountingGroup(topo.replica) if topo.replica is not None else None
        layers = _build(cfg, sds, counting, topo.across_dp, replica)
        case = result["cases"][name] = {
            "dp": dp,
            "rows": [[l.table.start, l.table.end, l.spec.rows] for l in layers],
            "bytes_per_token": [l.etp.bytes_per_token(l.spec.num_heads) for l in layers],
            "runs": [],
        }
        if counting is not None:  # this rank's share of rows, and tokens that need other ranks' rows
            for l in layers:
                if (l.table.start, l.table.end) != owned_rows(l.spec.rows, group.rank_in_group, group.world_size):
                    failures.append(f"{name}: rank {rank} owns [{l.table.start}, {l.table.end})")
            batch, _ = schedule_step(cfg, SCHEDULES, dp, FIRST_PREFILL[dp], len(LAYERS))
            rows = ngram_ids(layers[0].spec, batch.input_ids, batch.query_start_loc, torch.full((batch.num_requests, 2), EOS))
            owned = (rows >= layers[0].table.start) & (rows < layers[0].table.end)
            case["owned_fraction"] = owned.float().mean().item()
            if bool(owned.all()):
                failures.append(f"{name}: rank {rank} owns every row its tokens use: the combine is not exercised")
        for prefetch in (False, True):
            for mt_mode in MT_MODES:
                label = f"{name} rank {rank} prefetch={'on' if prefetch else 'off'} max_tokens={mt_mode}"
                for c in (counting, replica):
                    if c is not None:
                        c.reset()
                try:
                    got = _run_steps(cfg, layers, dp, prefetch, mt_mode)
                except Exception:
                    raise RuntimeError(f"{label} raised:\n{traceback.format_exc()}") from None
                compare_steps(got, ref_runs[dp], label, failures)
                moved = sum(c.bytes for c in (counting, replica) if c is not None)
                want = sum(_expected_bytes(l, dp, mt_mode) for l in layers)
                if moved != want:
                    failures.append(f"{label}: combine moved {moved} B, bytes_per_token predicts {want} B")
                case["runs"].append({"prefetch": prefetch, "max_tokens": mt_mode, "bytes": moved})
        if topo.across_dp:
            _capacity_error_case(cfg, layers, rank, counting, failures)
            _empty_batch_lookup(cfg, layers, refs, dp, name, failures)
    if world == 4:
        result["rows_fewer_than_ranks"] = _rows_fewer_than_ranks(rank, world, failures)
    dist.barrier()
    dist.destroy_process_group()
    result["seconds"] = time.perf_counter() - t0
    write_result(tmp, rank, result)


# ---- test side -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    cfg = tiny_text_config()
    for i, _ in LAYERS:
        spec = NgramHashSpec.from_config(cfg, i)
        assert (spec.num_heads, spec.head_dim) == (HEADS, HEAD_DIM)  # what the hand byte counts assume
    path = tmp_path_factory.mktemp("etp_weights") / "weights.safetensors"
    save_state_dicts([ple_state_dict(cfg, i, q, seed=10 + i) for i, q in LAYERS], path)
    return path


@pytest.mark.parametrize("world", [2, 4])
def test_etp_matches_single_process(world, weights, tmp_path):
    results = spawn_workers(_etp_worker, world, tmp_path / "run", str(weights))
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:40])
    for r in results:
        assert set(r["cases"]) == set(CASES[world]), r["cases"].keys()
        for name, case in r["cases"].items():
            assert len(case["runs"]) == 2 * len(MT_MODES)
            assert case["bytes_per_token"] == [HAND_BYTES_PER_TOKEN[name]] * len(LAYERS), (name, case["bytes_per_token"])
    # the row ranges of each ETP group tile the table
    rows = {name: [r["cases"][name]["rows"][0] for r in results] for name in CASES[world]}
    n = rows[CASES[world][0]][0][2]
    assert [r[:2] for r in rows.get("tp2", rows.get("tp2xdp2"))] == ([[0, n // 2], [n // 2, n]] * (world // 2))
    across = rows["dp2_across" if world == 2 else "tp2xdp2_across"]
    assert [r[:2] for r in across] == [list(owned_rows(n, k, world)) for k in range(world)]
    if world == 4:
        # the table each rank's ETPLookup built, with across_dp off and on
        assert [r["rows_fewer_than_ranks"] for r in results] == [[[0, 1]] * 2, [[1, 2]] * 2, [[2, 3]] * 2, [[3, 3]] * 2]


def test_a_wrong_etp_combine_is_caught(weights, tmp_path):
    """TP2 with rank 1's rows counted twice in the all-reduce: every run's bit-exact comparison must fail."""
    results = spawn_workers(_etp_worker, 2, tmp_path / "run", str(weights), True)
    failures = [f for r in results for f in r["failures"] if f.startswith("tp2 ") and " output differs " in f]
    diffs = [float(re.search(r"max\|diff\| (\S+)\)", f).group(1)) for f in failures]
    print(f"ETP-FAULT tp2: {len(failures)} outputs differ, max|diff| up to {max(diffs, default=0):.3g} (tolerance: equal)")
    assert {f.split(": ")[0] for f in failures} == {
        f"tp2 rank {r} prefetch={p} max_tokens={m}" for r in (0, 1) for p in ("off", "on") for m in MT_MODES
    }


class FakeGroup:
    """Rank `rank` of `world`; any collective is an error (checks that errors come before communication)."""

    def __init__(self, rank, world):
        self.rank_in_group, self.world_size = rank, world

    def _no(self, *a, **k):
        raise AssertionError("collective called")

    all_reduce = all_gather = reduce_scatter = _no


def test_etp_builds_the_table_of_its_rank():
    """ETPLookup builds its rank's table itself: the rows `owned_rows` gives that rank, nothing else (no
    collective while building); a group of one is no group."""
    rows, dim = 10, 4
    cases = [  # (group, across_dp, the rows the table must own)
        (FakeGroup(0, 2), False, (0, 5)),
        (FakeGroup(1, 2), False, (5, 10)),
        (None, False, (0, 10)),  # no group: the whole table
        (FakeGroup(0, 3), True, (0, 4)),
        (FakeGroup(2, 3), True, (7, 10)),
        (FakeGroup(0, 1), True, (0, 10)),  # a group of one: the whole table
    ]
    for group, across, want in cases:
        etp = ETPLookup(rows, dim, PLEStorage("bf16", etp_group=group, across_dp=across))
        rank, world = (group.rank_in_group, group.world_size) if group is not None else (0, 1)
        assert (etp.table.start, etp.table.end) == want == owned_rows(rows, rank, world), (rank, world)
        assert (etp.table.rows, etp.table.dim) == (rows, dim)
        assert etp.table.weight.shape == (want[1] - want[0], dim) and etp.table.weight.dtype == torch.bfloat16
        assert etp.across_dp == (across and world > 1)
        assert (etp.group is None) == (world == 1)
    # the PLETable keywords reach the table
    q = ETPLookup(rows, dim, PLEStorage("int8", etp_group=FakeGroup(1, 2)), shard_rows=3)
    assert (q.table.start, q.table.end, q.table.shard_rows, q.table.weight.dtype) == (5, 10, 3, torch.int8)
    # a layer's table is its ETPLookup's, over its rank's rows
    cfg = tiny_text_config()
    layer = PLELayer(cfg, 0, PLEStorage(etp_group=FakeGroup(1, 2)), dtype=torch.float32)
    assert layer.table is layer.etp.table
    assert (layer.table.start, layer.table.end) == owned_rows(layer.spec.rows, 1, 2)


@pytest.mark.parametrize("rows", [0, 1, 3, 5, 1376])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_owned_rows_tile_the_table_even_with_more_ranks_than_rows(rows, world):
    ranges = [owned_rows(rows, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in rank order
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0
    if world > rows:  # the first `rows` ranks own one row each, the rest an empty range at the end
        assert ranges == [(r, r + 1) for r in range(rows)] + [(rows, rows)] * (world - rows)
    # and the shards' lookups (zeros where not owned) add up to the whole table's, exactly
    full = torch.randn(rows, 3).to(torch.bfloat16)
    ids = torch.randint(0, max(rows, 1), (6, 2)) if rows else torch.full((6, 2), -1)
    parts = []
    for s, e in ranges:
        t = PLETable(rows, 3, PLEStorage("bf16"), start=s, end=e)
        t.load_shard(0, full)
        parts.append(t.lookup(ids))
    assert torch.equal(torch.stack(parts).sum(0), gather_dequant_reference(ids, full, None, 0, kind=BF16))


def test_bytes_per_token_hand_computed():
    """The numbers the multi-process test checks against what its collectives move, and the real scale."""
    small = {(w, a): ETPLookup(64, 8, PLEStorage("bf16", etp_group=FakeGroup(0, w), across_dp=a)) for w in (2, 4) for a in (False, True)}
    assert small[2, False].bytes_per_token(4) == 64  # all-reduce: 2*(2-1)/2 * 4*8*2 B
    assert small[2, True].bytes_per_token(4) == 96  # 1 * 4 ids * 8 B + 1 * 64 B
    assert small[4, False].bytes_per_token(4) == 96  # 2*3/4 * 64 B
    assert small[4, True].bytes_per_token(4) == 288  # 3*32 + 3*64
    assert ETPLookup(64, 8, PLEStorage("bf16")).bytes_per_token(4) == 0
    # real model: 16 heads x d=128 (4 KiB bf16 per token); TP4 all-reduce, and TP4 x DP2 across DP
    rows = 1 << 20
    tp4 = ETPLookup(rows, 128, PLEStorage(device="meta", etp_group=FakeGroup(0, 4)))
    assert tp4.bytes_per_token(16) == 2 * 3 * 4096 // 4 == 6144
    x8 = ETPLookup(rows, 128, PLEStorage(device="meta", etp_group=FakeGroup(0, 8), across_dp=True))
    assert x8.bytes_per_token(16) == 7 * 16 * 8 + 7 * 4096 == 29568


def test_capacity_and_max_tokens_errors_come_before_any_collective():
    cfg = tiny_text_config()
    layer = PLELayer(cfg, 0, PLEStorage(etp_group=FakeGroup(0, 2), across_dp=True), dtype=torch.float32)
    ws = PrefetchWorkspace([layer], 4, "cpu")
    state = PLEState.zeros(layer.state_shapes(), SLOTS, torch.float32)

    def batch(T, ids=None, max_tokens=None):
        ids = torch.randint(0, 97, (T,)) if ids is None else ids
        return PLEBatch.from_lengths(ids, [T], [0], [False], max_tokens=max_tokens)

    with pytest.raises(ValueError, match="5 tokens exceed the workspace capacity max_tokens=4"):
        ws.handles[0].start(batch(5, max_tokens=5), state)  # this rank over capacity
    with pytest.raises(ValueError, match="5 tokens exceed the workspace capacity max_tokens=4"):
        ws.handles[0].start(batch(2, max_tokens=5), state)  # another DP rank over capacity: every rank knows from max_tokens
    with pytest.raises(ValueError, match="holds 3 tokens, more than max_tokens=2"):
        layer.lookup(batch(3, max_tokens=2), state)
    solo = PLELayer(cfg, 0, dtype=torch.float32)  # no group: the capacity still holds
    with pytest.raises(ValueError, match="capacity"):
        PrefetchWorkspace([solo], 4, "cpu").handles[0].start(batch(5, ids=torch.zeros(5, dtype=torch.int64)), state)


def test_forward_with_no_requests():
    cfg = tiny_text_config()
    layer = PLELayer(cfg, 0, dtype=torch.float32)
    state = PLEState.zeros(layer.state_shapes(), SLOTS, torch.float32)
    state.ngram.random_(0, cfg.vocab_size), state.conv.normal_()
    before = state.clone()
    batch = PLEBatch.from_lengths(torch.zeros(0, dtype=torch.int64), [], [], [])
    out = layer(torch.zeros(0, cfg.hidden_size * cfg.hc_count), batch, state)
    assert out.shape == (0, cfg.hidden_size * cfg.hc_count) and out.dtype == torch.float32
    assert torch.equal(state.ngram, before.ngram) and torch.equal(state.conv, before.conv)  # no slot written


def test_across_dp_moves_at_most_upstreams_bytes():
    """Each token once (1/TP slices) beats upstream's DP gather + all-reduce at every TP x DP <= 8 x 8,
    real head geometry (16 heads x 128)."""
    from benchmarks.plan_memory import upstream_bytes_per_token
    from qwen4_exp_hcu.ple.etp import combine_bytes

    for tp in range(1, 9):
        for dp in range(2, 9):
            tokens = 256 * tp  # a multiple of TP: per-token rates compare exactly
            ours = combine_bytes(tp * dp, True, 16, 128, tokens, tp)
            assert ours <= upstream_bytes_per_token(tp * dp, dp, 16, 128) * tokens, (tp, dp)
            assert ours < (tp * dp - 1) * (16 * 8 + 16 * 128 * 2) * tokens or tp == 1  # every TP rank sending every token
