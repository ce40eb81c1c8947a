"""PLE rows read from the checkpoint's files (`qwen4_exp_hcu.ple.tiers.file_rows`): every budget of resident rows
looks up exactly what the whole table in host memory looks up, on checkpoints from our writer and on the
census-built release layouts (BF16, FP8, NVFP4); missing and truncated files fail at load, naming the file."""

import dataclasses
import gc
import json
import weakref

import pytest
import torch
from helpers.releases import write_release

from qwen4_exp_hcu.names import ple_layers
from qwen4_exp_hcu.ple.checkpoint import load_ple_layer, text_config_of
from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
from qwen4_exp_hcu.ple.tiers.file_rows import FileTier
from qwen4_exp_hcu.ple.storage import PLEStorage

BUDGETS = (1.0, 0.5, 0.2, 0.05, 0.0)  # share of the table's bytes kept resident


class _Rank:
    """An ETP group seen from one rank: enough for the owned row range."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank_in_group, self.world_size = rank, world


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("releases")
    return {"int8": tiny["int8"], **{r: write_release(root / r, r) for r in ("bf16", "fp8", "nvfp4")}}


def _layer_id(path) -> int:
    return ple_layers(text_config_of(path))[-1].layer_id


def _ids(table, n_tokens: int, seed: int) -> torch.Tensor:
    """Row ids of `n_tokens` tokens x 4 heads: skewed (a few rows read often, as n-grams of text are), some not
    owned by the rank (-1, beyond the range) so zeros are checked too."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, table.rows, (8,), generator=g)
    ids = torch.where(torch.rand(n_tokens, 4, generator=g) < 0.6, hot[torch.randint(0, 8, (n_tokens, 4), generator=g)],
                      torch.randint(0, table.rows, (n_tokens, 4), generator=g))  # fmt: skip
    ids[0, 0] = -1
    return ids


def _tier(path, table, share: float, refresh_every: int = 0) -> FileTier:
    return FileTier(CheckpointFiles(path), int(share * table.nbytes), refresh_every=refresh_every, staging_rows=16)


@pytest.mark.parametrize("release", ["int8", "bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("rank", [None, 1], ids=["whole", "rank1of3"])
def test_every_budget_looks_up_what_the_host_table_does(checkpoints, release, rank):
    """Resident rows from calibration ids, then from traffic (promotions every 2 lookups): bit-exact at every
    budget, also for an ETP rank whose row range starts inside a checkpoint shard."""
    path = checkpoints[release]
    storage = PLEStorage(host=True, etp_group=None if rank is None else _Rank(rank, 3))
    whole = load_ple_layer(path, _layer_id(path), storage).table
    assert 0 < whole.start or rank is None
    for share in BUDGETS:
        for refresh_every in (0, 2):
            tiered = dataclasses.replace(storage, file_tier=_tier(path, whole, share, refresh_every))
            table = load_ple_layer(path, _layer_id(path), tiered).table
            rows = table.file_rows
            assert rows.slots == min(int(share * whole.nbytes) // (whole.nbytes // (whole.end - whole.start)), whole.end - whole.start)
            assert (rows.slot_of >= 0).all() == (share == 1.0)  # a budget that holds the table holds it all at load
            if not refresh_every:
                rows.fill(_ids(table, 64, seed=0))
                assert rows.staging.capacity == 16, "the fill grew the staging area"  # it goes through staging in parts
            for step in range(5):
                ids = _ids(table, 3 + 7 * step, seed=step)
                assert torch.equal(table.lookup(ids), whole.lookup(ids)), (release, share, refresh_every, step)
            if refresh_every and 0 < rows.slots < rows.n:
                assert rows.refreshes == 2 and (rows.slot_row >= 0).any()


def test_resident_rows_are_the_most_read(checkpoints):
    """Two resident slots: the two most frequent rows take them; they serve 6 of the 8 lookups."""
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    row = whole.nbytes // (whole.end - whole.start)
    tier = FileTier(CheckpointFiles(path), 2 * row, refresh_every=0)
    rows = load_ple_layer(path, _layer_id(path), PLEStorage(host=True, file_tier=tier)).table.file_rows
    assert rows.fill(torch.tensor([[5, 5, 5, 7], [7, 5, 9, 11]])) == 0.75
    assert rows.slots == 2 and set(rows.slot_row.tolist()) == {5, 7}


@pytest.mark.parametrize("share", [0.2, 0.05])
@pytest.mark.parametrize("rank", [None, 1], ids=["whole", "rank1of3"])
def test_a_calibrated_start_fills_every_slot_the_budget_pays_for(checkpoints, share, rank):
    """Serving's calibrated start (`host_table_calibration`: a token stream's row ids, `fill_resident_rows`): a
    stream holding more of the rank's rows than the budget has slots fills every slot; a short one leaves slots
    empty, which the description (logged at start-up) says."""
    path = checkpoints["int8"]
    storage = PLEStorage(host=True, etp_group=None if rank is None else _Rank(rank, 3))
    layer = load_ple_layer(path, _layer_id(path), storage)
    tiered = dataclasses.replace(storage, file_tier=_tier(path, layer.table, share))
    table = load_ple_layer(path, _layer_id(path), tiered).table
    rows = table.file_rows
    assert 0 < rows.slots < rows.n
    tokens = torch.randint(0, text_config_of(path).vocab_size, (4 * rows.n,), generator=torch.Generator().manual_seed(0))
    ids = layer.calibration_ids(tokens)
    local = ids.reshape(-1) - table.start
    assert torch.unique(local[(local >= 0) & (local < rows.n)]).numel() > rows.slots  # enough distinct rows
    table.fill_resident_rows(ids)
    assert rows.filled == rows.slots and "stay empty" not in rows.describe()
    short = _tier(path, layer.table, share)
    rows = load_ple_layer(path, _layer_id(path), dataclasses.replace(storage, file_tier=short)).table.file_rows
    rows.fill(torch.tensor([table.start, table.start + 1]))
    assert rows.filled == 2 and f"{rows.slots - 2} slots stay empty" in rows.describe()


def test_a_missing_file_fails_at_load_naming_it(checkpoints, tmp_path):
    src = checkpoints["int8"]
    dst = tmp_path / "split"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    (dst / "model-00001-of-00002.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    weight_map = {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors .*does not exist"):
        CheckpointFiles(dst)


def test_a_truncated_file_fails_at_load_naming_it(checkpoints, tmp_path):
    src = checkpoints["int8"]
    dst = tmp_path / "cut"
    dst.mkdir()
    data = (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model.safetensors is truncated: .* ends at byte"):
        CheckpointFiles(dst)
    (dst / "model.safetensors").write_bytes(data[:20])
    with pytest.raises(ValueError, match="model.safetensors is truncated"):
        CheckpointFiles(dst)


def test_rows_are_read_as_stored(checkpoints):
    """A BF16 checkpoint asked to serve INT8 from its files would need quantizing every read: an error."""
    path = checkpoints["bf16"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    with pytest.raises(ValueError, match=r"read as stored \(bf16\), but the table is int8"):
        load_ple_layer(path, _layer_id(path), PLEStorage("int8", host=True, file_tier=_tier(path, whole, 0.2)))


def test_file_rows_do_not_hold_the_table(checkpoints):
    """Host bytes of a 5 % budget: the resident rows and a small staging area, not the table."""
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    table = load_ple_layer(path, _layer_id(path), PLEStorage(host=True, file_tier=_tier(path, whole, 0.05))).table
    row = whole.nbytes // (whole.end - whole.start)
    assert table.nbytes == (table.file_rows.slots + 16) * row < whole.nbytes


def test_a_file_tier_table_is_freed_when_dropped(checkpoints):
    """Its maps and pinned staging go with its last reference, not when the cycle collector next runs: the tier
    grows staging through the table without holding it. Fault: the tier holding the table's bound allocator."""
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    table = load_ple_layer(path, _layer_id(path), PLEStorage(host=True, file_tier=_tier(path, whole, 0.05))).table
    table.lookup(_ids(table, 64, seed=3))  # staging (16 rows) grows
    gone = weakref.ref(table), weakref.ref(table.file_rows.staging)
    gc.disable()
    try:
        del table
        assert [ref() for ref in gone] == [None, None]
    finally:
        gc.enable()



@pytest.mark.cpu_only  # the kernel over CPU tensors runs under the interpreter, where no GPU is
@pytest.mark.parametrize("observe", [False, True], ids=["cache_from_calibration", "cache_from_traffic"])
def test_a_hot_row_cache_in_front_of_the_files_changes_nothing(checkpoints, monkeypatch, observe):
    """The GPU hot-row cache before a 5 % file tier, the cache kept on the CPU and the lookup kernel run under
    the interpreter (on an accelerator `PLETable.enable_hot_rows` builds the same; the next test runs it on the GPU): every lookup equals the whole host table's; the cache holds the files' rows; the pairs it serves are
    neither staged nor counted by the file tier, so host memory keeps the next most read rows."""
    from qwen4_exp_hcu.ple import table as table_module
    from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows

    monkeypatch.setattr(table_module, "dispatch", lambda launcher, reference, *args, out, options, **kw: launcher(*args, out=out, **kw, **options))
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    table = load_ple_layer(path, _layer_id(path), PLEStorage(host=True, file_tier=_tier(path, whole, 0.05, refresh_every=2))).table
    rows = table.file_rows
    hot = table.hot = HotRows(rows.mapped("weight"), rows.mapped("weight_scale"), table.start, 4, "cpu", observe)
    hot.refresh_every = 2
    if not observe:  # both tiers calibrated: host memory takes the most frequent rows the cache does not hold
        hot.fill(_ids(table, 64, seed=0))
        table.fill_resident_rows(_ids(table, 64, seed=0))
        resident, cached = set(rows.slot_row[rows.slot_row >= 0].tolist()), set(hot.slot_row.tolist())
        assert resident and not resident & cached
    hits = 0
    for step in range(6):
        ids = _ids(table, 3 + 7 * step, seed=0)  # the same 8 rows take 60 % of every step's lookups
        hits += int((hot.slots_of(ids) >= 0).sum())
        assert torch.equal(table.lookup(ids), whole.lookup(ids)), (observe, step)
    assert hits > 40  # of 546 (token, head) pairs
    filled = (hot.slot_row >= 0).nonzero().flatten()
    assert filled.numel() == 4 and rows.refreshes == 3 + (not observe)  # 3 from traffic, 1 from calibration
    assert torch.equal(hot.rows[filled], whole.weight[hot.slot_row[filled]])
    assert torch.equal(hot.row_scales[filled], whole.scale[hot.slot_row[filled]])
    if not observe:  # a fixed cache: its rows were never counted nor made resident by the file tier
        cached = hot.slot_row[filled].numpy()
        assert (rows.counts[cached] == 0).all() and (rows.slot_of[cached] == -1).all()
    else:  # a refresh whose top is already cached reads no row from the files (an empty read)
        counts, held = torch.zeros(hot.n, dtype=torch.int32), hot.slot_row.clone()
        counts[held[filled]] = 1
        assert hot.refresh(counts) == 1.0 and torch.equal(hot.slot_row, held)
        assert torch.equal(hot.rows[filled], whole.weight[hot.slot_row[filled]])


@pytest.mark.gpu
def test_a_gpu_hot_row_cache_in_front_of_the_files_changes_nothing_on_the_gpu(checkpoints):
    """`PLETable.enable_hot_rows` on a file-tier table read by the GPU: a cache filled from calibration ids,
    then one following the traffic, before a 5 % budget; every lookup equals the whole host table's."""
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    storage = PLEStorage(device="cuda", host=True, file_tier=_tier(path, whole, 0.05, refresh_every=2))
    table = load_ple_layer(path, _layer_id(path), storage).table
    for observe in (False, True):
        hot = table.enable_hot_rows(4, observe)
        hot.refresh_every = 2
        if not observe:
            hot.fill(_ids(table, 64, seed=0).cuda())
        for step in range(6):
            ids = _ids(table, 3 + 7 * step, seed=0)
            assert torch.equal(table.lookup(ids.cuda()).cpu(), whole.lookup(ids)), (observe, step)
        assert int((hot.slot_row >= 0).sum()) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("release", ["int8", "fp8"])
def test_a_cuda_graph_replays_the_file_reads(checkpoints, release):
    """A lookup's host part is a host node (`tiers.host_call`): a graph captured once replays with new ids, rows
    promoted between its replays (every 2 lookups, inside the host function), and every replay and the eager
    lookups between them equal the whole host table."""
    path = checkpoints[release]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    tier = dataclasses.replace(_tier(path, whole, 0.2, refresh_every=2), staging_rows=256)
    table = load_ple_layer(path, _layer_id(path), PLEStorage(device="cuda", host=True, file_tier=tier)).table
    static = _ids(table, 24, seed=0).cuda()
    table.lookup(static)  # eager: sizes the pinned ids and slots before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = table.lookup(static)
    for step in range(8):
        ids = _ids(table, 24, seed=100 + step)
        static.copy_(ids)
        graph.replay()
        assert torch.equal(out.cpu(), whole.lookup(ids)), (release, step)
        eager = _ids(table, 5, seed=200 + step)
        assert torch.equal(table.lookup(eager.cuda()).cpu(), whole.lookup(eager)), (release, step)
    assert table.file_rows.refreshes >= 8 and (table.file_rows.slot_row >= 0).any()
    with pytest.raises(ValueError, match="CUDA graphs hold their addresses"):  # the graph would read freed buffers
        table.lookup(_ids(table, 100, seed=9).cuda())  # 400 ids, staging 256


@pytest.mark.gpu
def test_side_stream_lookups_in_graph_replays_read_this_replays_rows(checkpoints):
    """As serving runs them: two tables' lookups on a side stream forked from and joined back to the main one, in
    one CUDA graph, each lookup's output copied on the main stream after the join. 200 replays alternate two id sets
    from disjoint row ranges, so every replay's staging area holds other rows than the last one's, with eager steps
    between them; every output equals the whole table's (a stale staged row, or a join that does not wait for the
    host node, would show)."""
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    tier = dataclasses.replace(_tier(path, whole, 0.2), staging_rows=256)  # calibrated resident rows: none promoted
    tables = [load_ple_layer(path, _layer_id(path), PLEStorage(device="cuda", host=True, file_tier=tier)).table for _ in range(2)]
    for t in tables:
        t.fill_resident_rows(_ids(t, 64, seed=0))
    half = whole.rows // 2
    sets = [torch.randint(lo, lo + half, (2, 16, 4), generator=torch.Generator().manual_seed(lo)) for lo in (0, half)]
    static = [sets[0][k].cuda() for k in range(2)]
    outs = [torch.empty(16, 4 * whole.dim, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    copies = [torch.empty_like(o) for o in outs]
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()

    def step():
        for table, ids, out, copy in zip(tables, static, outs, copies):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                table.lookup(ids, out=out)
            torch.cuda.current_stream().wait_stream(side)
            copy.copy_(out)  # the main stream's first read of the lookup

    step()  # eager: sizes the pinned ids and slots before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(200):
        ids = sets[replay % 2]
        for k in range(2):
            static[k].copy_(ids[k])
        graph.replay() if replay % 10 else step()  # every tenth step eager
        main.synchronize()
        for k in range(2):
            assert torch.equal(copies[k].cpu(), whole.lookup(ids[k])), (replay, k)


def test_buffers_a_cuda_graph_holds_do_not_grow(checkpoints):
    """After a capture, a lookup with more ids than staging fails naming `staging_rows`: growing would free the
    buffers (staging, pinned ids) whose addresses the graph replays."""
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    rows = load_ple_layer(path, _layer_id(path), PLEStorage(host=True, file_tier=_tier(path, whole, 0.2))).table.file_rows
    rows.staging.captured = True  # as `stage` marks it when a CUDA graph captures a lookup
    with pytest.raises(ValueError, match=r"17 row ids needs a staging area \(16 rows\).*CUDA graphs hold.*`staging_rows`"):
        rows.staging.reserve(17, torch.device("cuda"))


@pytest.mark.gpu
def test_a_lookup_queues_its_file_reads_without_waiting(checkpoints):
    """The host thread queues a lookup behind a second of GPU work and goes on: when `lookup` returns, the GPU work
    is still running and the host function has not run (its file reads wait in the stream, behind that work); a
    path that brought the ids to the host first would have waited for the GPU work to finish."""
    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True)).table
    storage = PLEStorage(device="cuda", host=True, file_tier=_tier(path, whole, 0.05, refresh_every=2))
    table = load_ple_layer(path, _layer_id(path), storage).table
    staging = table.file_rows.staging
    ids = _ids(table, 24, seed=1).cuda()  # before the GPU work: a copy from pageable memory would wait for it
    table.lookup(ids)
    torch.cuda.synchronize()
    calls = staging.host_stats().calls
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock
    busy = torch.cuda.Event()
    busy.record()
    out = table.lookup(ids)
    assert not busy.query() and staging.host_stats().calls == calls  # queued behind the GPU work, not waited for
    torch.cuda.synchronize()
    assert staging.host_stats().calls == calls + 1
    assert torch.equal(out.cpu(), whole.lookup(ids.cpu()))


def _synthetic_rows(path, n: int, slots: int, **tier) -> "FileRows":
    """File rows over a one-tensor checkpoint of `n` rows of 4 bytes (row r holds r's low bytes), `slots` resident."""
    from safetensors.torch import save_file

    from qwen4_exp_hcu.ple.tiers.file_rows import FileRows

    save_file({"model.layers.0.ple.weight": torch.arange(n, dtype=torch.int32).view(torch.int8).view(n, 4)}, path / "model.safetensors")
    buffers = {}

    def resize(rows, keep=0):
        buffers["weight"] = torch.zeros((rows, 4), dtype=torch.int8)
        return dict(buffers)

    rows = FileRows(FileTier(CheckpointFiles(path), slots * 4, **tier), 0, n, n, 4, resize)
    rows.add_shard(0, {"weight": "model.layers.0.ple.weight"})
    rows.loaded()
    return rows


def _read(rows, ids) -> None:
    """A lookup's host part: `ids` counted and their rows staged (through the C host function)."""
    rows.stage(torch.as_tensor(ids, dtype=torch.int64))


def test_promotions_work_on_the_rows_read_not_the_table(monkeypatch, tmp_path):
    """At the release's 80 M rows per rank, partitioning every row's count takes seconds per promotion: promotions
    partition only the rows counted since their counts were last zero; a resident row keeps its slot until a
    newcomer needs one (clock order); the slot maps stay each other's inverse."""
    import numpy as np

    n = 1_000_000
    rows = _synthetic_rows(tmp_path, n, 64, refresh_every=4, staging_rows=256)
    monkeypatch.setattr(rows, "_read_into_slots", lambda r, s: None)  # the bookkeeping alone
    sizes = []
    topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda a, k, **kw: sizes.append(a.numel()) or topk(a, k, **kw))
    rng = np.random.default_rng(0)
    first = np.arange(40)
    for _ in range(4):  # 40 rows read, 64 slots: all become resident
        _read(rows, first)
    assert sorted(rows.slot_row[rows.slot_row >= 0].tolist()) == first.tolist()
    for _ in range(4):  # 30 other rows, read more often: they take the 24 empty slots and 6 of the first rows'
        _read(rows, np.repeat(np.arange(1000, 1030), 3))
    resident = set(rows.slot_row[rows.slot_row >= 0].tolist())
    assert set(range(1000, 1030)) <= resident and len(resident & set(first.tolist())) == 34
    for _ in range(16):
        _read(rows, rng.integers(0, n, 50))
    assert rows.refreshes == 6 and max(sizes) <= 4 * 50 + 70 < n
    held = rows.slot_row >= 0
    assert (rows.slot_of[rows.slot_row[held]] == np.flatnonzero(held)).all()
    assert (rows.slot_of >= 0).sum() == held.sum()


def test_a_promotion_reads_at_most_promote_rows_newcomers_the_most_read_first(monkeypatch, tmp_path):
    """A promotion runs inside a lookup. After a long prefill an uncapped one reads every counted row from the files
    at once (139-167 ms of one decode lookup on this machine, `bench_file_promotions`): `promote_rows` newcomers at a
    time, the most counted first, and later promotions bring the rest."""
    import numpy as np

    rows = _synthetic_rows(tmp_path, 1000, 64, refresh_every=1, promote_rows=8, staging_rows=256)
    read = []
    monkeypatch.setattr(rows, "_read_into_slots", lambda r, s: read.append(r.size))
    _read(rows, np.concatenate([np.arange(40), np.repeat(np.arange(100, 105), 3)]))  # a prefill: 45 rows counted
    resident = set(rows.slot_row[rows.slot_row >= 0].tolist())
    assert read == [8] and set(range(100, 105)) <= resident and len(resident) == 8
    assert rows.share == pytest.approx((15 + 3) / (40 + 15))  # what the resident rows serve of the counts
    for _ in range(5):  # the rows read once were forgotten (counts halve); read again, they come 8 at a time
        _read(rows, np.arange(40))
    assert read == [8, 8, 8, 8, 8, 5] and int((rows.slot_row >= 0).sum()) == 45


def test_a_shard_the_files_lack_fails_at_load_naming_it(tmp_path):
    """Rows in two checkpoint shards of 500, only the first mapped: `loaded` names the second (the C host function
    would otherwise read through a null pointer)."""
    from safetensors.torch import save_file

    from qwen4_exp_hcu.ple.tiers.file_rows import FileRows

    save_file({"model.layers.0.ple.weight": torch.zeros(500, 4, dtype=torch.int8)}, tmp_path / "model.safetensors")
    rows = FileRows(FileTier(CheckpointFiles(tmp_path), 0), 0, 1000, 500, 4, lambda n, keep=0: {"weight": torch.zeros(n, 4, dtype=torch.int8)})
    rows.add_shard(0, {"weight": "model.layers.0.ple.weight"})
    with pytest.raises(ValueError, match="checkpoint shard 1 of the table's rows was not found in"):
        rows.loaded()


def test_a_full_list_of_candidates_promotes_early(tmp_path):
    """Rows first read since the last promotion are its candidates, `FRESH_ROWS` of them at most: a lookup that
    reads more (a long prefill) promotes as the list fills, and counts every row once."""
    import numpy as np

    from qwen4_exp_hcu.ple.tiers import file_rows

    rows = _synthetic_rows(tmp_path, 1000, 8, refresh_every=1000, staging_rows=256)
    rows._fresh = np.empty(10, dtype=np.int64)  # as `FRESH_ROWS` = 10
    rows.staging.state.fresh, rows.staging.state.fresh_cap = rows._fresh.ctypes.data, 10
    _read(rows, np.repeat(np.arange(100, 125), 2))  # 25 rows: promotions at the 11th and the 21st
    assert rows.refreshes == 2 and rows.staging.state.fresh_len == 5 and file_rows.FRESH_ROWS > 1000
    held = rows.slot_row[rows.slot_row >= 0]
    assert held.size == 8 and set(held.tolist()) <= set(range(100, 120))


def test_padding_tokens_read_no_file_and_are_not_counted(checkpoints):
    """Tokens past the last request's (a batch padded to a size), or past `num_real_tokens` (a full graph's padding
    requests), with the file tier: their rows are neither read from the files nor counted (they would promote the
    hash of token 0), and the real tokens' embeddings are the whole table's."""
    from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState

    path = checkpoints["int8"]
    whole = load_ple_layer(path, _layer_id(path), PLEStorage(host=True))
    tiered = load_ple_layer(path, _layer_id(path), PLEStorage(host=True, file_tier=_tier(path, whole.table, 0.05, refresh_every=1000)))
    ids = torch.tensor([5, 17, 23, 9, 0, 0, 0])  # two requests of 2 tokens, 3 padding tokens
    batch = PLEBatch.from_lengths(ids, [2, 2], [0, 1], [False, False])
    state = PLEState.zeros(whole.state_shapes(), 2, torch.bfloat16)
    rows = tiered.table.file_rows
    before = rows.counts.sum()
    got, want = tiered.lookup(batch, state), whole.lookup(batch, state)
    assert torch.equal(got[:4], want[:4])
    assert rows.counts.sum() - before == 4 * whole.spec.num_heads  # the real tokens' rows, every head owned
    assert not got[4:].any()  # padding looked up no row

    decodes = PLEBatch.from_lengths(ids[:4], [1, 1, 1, 1], [0, 1, 0, 0], [True] * 4)  # a graph of 4, 2 real decodes
    padded = dataclasses.replace(decodes, num_real_tokens=torch.tensor(2))
    before = rows.counts.sum()
    got, want = tiered.lookup(padded, state), whole.lookup(decodes, state)
    assert torch.equal(got[:2], want[:2]) and not got[2:].any()
    assert rows.counts.sum() - before == 2 * whole.spec.num_heads
