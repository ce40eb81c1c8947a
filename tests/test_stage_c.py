"""`ple/tiers/stage.c`, the file tier's per-lookup host work, against its numpy oracle (the same work in
Python): on a checkpoint of several shard files with two parts of different row bytes, an owned range that starts
inside a shard, unowned ids, hot-row flags, promotions with and without a cap, and staging that grows mid-run, every
lookup maps ids to the same bytes, and the counts, candidates, promotions and resident slots stay identical, whether
the misses' pages are asked for first or not (`FileTier.ask_pages_first`); asked for after a fault, they are asked
for where the files' pages were dropped, and not where they are cached.
Promotions see their candidates sorted in both (numpy handed them over sorted, C in first-read order; which row
wins a tie at the cutoff is arbitrary)."""

import ctypes
import mmap
import resource

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from benchmarks.common import drop_page_cache
from qwen4_exp_hcu.ple.tiers import stager
from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
from qwen4_exp_hcu.ple.tiers.file_rows import FileRows, FileTier

W_BYTES, S_BYTES = 8, 2
WIDTHS = {"narrow": W_BYTES, "wide": 160}  # weight bytes a row: the 2-byte scales mapped / held in memory


class _Oracle:
    """Numpy staging and counting, the work of `stage.c` in Python, over another `FileRows`' buffers, slot maps
    and promotions."""

    def __init__(self, rows: FileRows) -> None:
        self.rows, self.counted, self.lookups = rows, [], 0

    def stage(self, ids: np.ndarray, cached: np.ndarray | None) -> np.ndarray:
        r = self.rows
        local = ids - r.start
        owned = (local >= 0) & (local < r.n)
        need = owned if cached is None else owned & ~cached
        wanted = local[need]
        if r.counts is not None:
            self.count(wanted)
        at = r.slot_of[wanted]
        miss = at < 0
        rows, inverse = np.unique(wanted[miss], return_inverse=True)
        r.shards.read(rows, r.staging.bytes, r.slots)
        at[miss] = r.slots + inverse.reshape(-1)
        slot = np.where(owned, 0, -1)
        slot[need] = at
        return slot

    def count(self, rows: np.ndarray) -> None:
        r = self.rows
        rows, times = np.unique(rows, return_counts=True)
        self.counted.append(rows[r.counts[rows] == 0])
        r.counts[rows] += times.astype(r.counts.dtype)
        self.lookups += 1
        if self.lookups >= r.tier.refresh_every:
            self.lookups = 0
            counted = np.concatenate(self.counted)
            r.promote(counted, r.counts[counted], r.tier.promote_rows)
            r.counts[counted] >>= 1
            self.counted = [counted[r.counts[counted] > 0]]


def _checkpoint(path, rows: int, shard_rows: int, seed: int, width: int = W_BYTES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weight = rng.integers(-128, 128, (rows, width), dtype=np.int8)
    scale = rng.integers(0, 256, (rows, S_BYTES), dtype=np.uint8)
    for j in range(-(-rows // shard_rows)):
        a, b = j * shard_rows, min((j + 1) * shard_rows, rows)
        save_file({f"model.layers.0.ple.shard_{j}.weight": torch.from_numpy(weight[a:b].copy()),
                   f"model.layers.0.ple.shard_{j}.weight_scale": torch.from_numpy(scale[a:b].copy()).view(torch.bfloat16)},
                  str(path / f"model-{j:05d}.safetensors"))  # fmt: skip
    return {"weight": weight.view(np.uint8), "weight_scale": scale}


def _rows(path, start: int, n: int, shard_rows: int, slots: int, width: int = W_BYTES, **tier) -> FileRows:
    buffers = {}

    def resize(count, keep=0):
        old = dict(buffers)
        buffers["weight"] = torch.zeros((count, width), dtype=torch.int8)
        buffers["weight_scale"] = torch.zeros((count, 1), dtype=torch.bfloat16)
        for k in old:
            buffers[k][:keep].copy_(old[k][:keep])
        return dict(buffers)

    rows = FileRows(FileTier(CheckpointFiles(path), slots * (width + S_BYTES), **tier), start, n, shard_rows, width + S_BYTES, resize)
    for j in range(start // shard_rows, (start + n - 1) // shard_rows + 1):
        rows.add_shard(j, {"weight": f"model.layers.0.ple.shard_{j}.weight", "weight_scale": f"model.layers.0.ple.shard_{j}.weight_scale"})
    rows.loaded()
    original = rows.promote
    rows.promote = lambda r, c, limit=None: original(np.sort(r), c[np.argsort(r)], limit)  # ties broken alike
    return rows


def _candidates(rows: FileRows) -> np.ndarray:
    return np.concatenate([rows._carried, rows._fresh[: rows.staging.state.fresh_len]])


CASES = {  # rows, shard_rows, start, n, slots, refresh_every, promote_rows, staging_rows, max_tokens
    "capped": (3000, 700, 900, 1500, 120, 3, 8, 16, 80),
    "uncapped": (3000, 700, 900, 1500, 120, 1, None, 16, 80),
    "no_slots": (3000, 1000, 0, 3000, 0, 2, 4, 8, 60),
    "all_resident": (2000, 300, 250, 400, 400, 2, None, 16, 60),
    "one_shard": (5000, 5000, 0, 5000, 300, 5, 4096, 64, 200),
    "odd_shards": (4000, 333, 1234, 1900, 50, 4, 3, 32, 150),
    "tiny_staging": (1000, 128, 100, 700, 200, 7, 16, 4, 40),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("ask", stager.ASK_PAGES_FIRST)
def test_the_c_host_function_matches_numpy(tmp_path, case, seed, ask, width):
    total, shard_rows, start, n, slots, every, limit, staging, max_tokens = CASES[case]
    table = _checkpoint(tmp_path, total, shard_rows, seed, WIDTHS[width])
    tier = dict(refresh_every=every, promote_rows=limit, staging_rows=staging, ask_pages_first=ask, width=WIDTHS[width])
    ours, oracle = _rows(tmp_path, start, n, shard_rows, slots, **tier), _Oracle(_rows(tmp_path, start, n, shard_rows, slots, **tier))
    rng = np.random.default_rng(seed)
    hot = rng.integers(start, start + n, 12)
    edges = np.array([-1, -7, start - 1, start + n, start + n + 5, total + 3, start, start + n - 1])
    for step in range(60):
        size = int(rng.integers(0, max_tokens + 1)) * 4
        kind = rng.random(size)
        ids = np.where(kind < 0.45, hot[rng.integers(0, hot.size, size)],
                       np.where(kind < 0.9, rng.integers(start, start + n, size), rng.choice(edges, size))).astype(np.int64)  # fmt: skip
        cached = rng.random(size) < 0.25 if step % 3 == 1 else None
        oracle.rows.staging.reserve(size, torch.device("cpu"))
        want = oracle.stage(ids, cached)
        got = ours.stage(torch.from_numpy(ids), None if cached is None else torch.from_numpy(cached)).numpy()
        owned = (ids >= start) & (ids < start + n)
        served = owned & cached if cached is not None else np.zeros_like(owned)  # by the hot-row cache: buffer row 0
        read = owned & ~served
        assert (got[~owned] == -1).all() and (got[served] == 0).all(), step
        for part, rows in table.items():
            assert np.array_equal(ours.staging.bytes[part][got[read]], rows[ids[read]]), (step, part)
        staged = got[read][got[read] >= ours.slots]  # each distinct missing row once, from the staging area's start
        distinct = np.unique(ids[read][got[read] >= ours.slots]).size
        assert np.unique(staged).size == distinct and (not distinct or staged.max() == ours.slots + distinct - 1), step
        assert np.array_equal(np.minimum(got, ours.slots), np.minimum(want, ours.slots)), step  # same resident slots
        r = oracle.rows
        assert np.array_equal(ours.counts, r.counts) and np.array_equal(ours.slot_of, r.slot_of), step
        assert np.array_equal(ours.slot_row, r.slot_row) and (ours.refreshes, ours.share) == (r.refreshes, r.share), step
        if ours.counts is not None:
            assert set(_candidates(ours).tolist()) == set(np.concatenate(oracle.counted).tolist() if oracle.counted else []), step
            assert ours.staging.state.lookups == oracle.lookups, step
    assert ours.staging.host_stats().calls == 60
    # "always" asks for every miss's pages (here the files' pages are cached: "after_a_fault" finds no fault)
    assert (ours.staging.pages_asked > 0) == (ask == "always" and slots < n)


def test_scales_held_in_memory_are_never_asked_for(tmp_path):
    """With 160-byte weight rows, the 2-byte scales are read into memory when their shard is added
    (`file_map.in_memory_parts`): a lookup asks only for its misses' weight pages, and its bytes are the files'."""
    table = _checkpoint(tmp_path, 3000, 700, 0, width=160)
    rows = _rows(tmp_path, 900, 1500, 700, 0, width=160, refresh_every=0, staging_rows=64, ask_pages_first="always")
    assert rows.shards.in_memory == ["weight_scale"] and rows.staging.state.in_memory == 0b10
    assert all(not isinstance(parts["weight_scale"], np.memmap) for parts in rows.shards.maps.values())
    ids = np.arange(900, 2400, 25, dtype=np.int64)  # 60 rows over 3 shards: a scale page each shard, a weight page a row
    got = rows.stage(torch.from_numpy(ids)).numpy()
    for part, want in table.items():
        assert np.array_equal(rows.staging.bytes[part][got], want[ids]), part
    weight_pages = sum(np.unique(np.concatenate([a // mmap.PAGESIZE, (a + 159) // mmap.PAGESIZE])).size
                       for j in range(1, 4) for a in [rows.shards.maps[j]["weight"].offset
                                                      + (ids[ids // 700 == j] - 700 * j) * 160])  # fmt: skip
    assert rows.staging.pages_asked == weight_pages


def _major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _drops_reach_the_drive(path) -> bool:
    """Whether a page of `path` dropped from the page cache is read from the drive when next touched (a major fault);
    not on a file system that keeps every page in memory (tmpfs)."""
    drop_page_cache(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        before = _major_faults()
        m[0]
        return _major_faults() > before


def test_after_a_fault_the_rest_of_the_pages_are_asked_for(tmp_path):
    """The files' pages dropped: the first copy faults, the lookup asks for the rest of its misses' pages, and the
    rows are exact. Looked up again, the pages are cached: nothing is asked."""
    table = _checkpoint(tmp_path, 3000, 700, 0)
    files = sorted(tmp_path.glob("*.safetensors"))
    if not _drops_reach_the_drive(files[0]):
        pytest.skip(f"{tmp_path}'s file system keeps dropped pages in memory: no read reaches the drive")
    rows = _rows(tmp_path, 900, 1500, 700, 0, refresh_every=0, staging_rows=64)
    ids = np.arange(900, 2400, 25, dtype=np.int64)  # 60 rows, several a page, over 3 shards
    for f in files:
        drop_page_cache(f)
    before = _major_faults()
    got = rows.stage(torch.from_numpy(ids)).numpy()
    faults, asked = _major_faults() - before, rows.staging.pages_asked
    for part, want in table.items():
        assert np.array_equal(rows.staging.bytes[part][got], want[ids]), part
    assert 0 < faults < 2 * ids.size and asked > 0, (faults, asked)
    assert "pages asked for first" in rows.describe()
    rows.stage(torch.from_numpy(ids))
    assert rows.staging.pages_asked == asked


def test_the_stager_mirror_lists_every_field():
    assert stager.library().qwen4_ple_stager_bytes() == ctypes.sizeof(stager.Stager)


def test_an_unknown_ask_pages_first_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="ask_pages_first is one of never, after_a_fault, always, not 'sometimes'"):
        FileTier(None, 0, ask_pages_first="sometimes")


@pytest.mark.parametrize("cap", [1, 7, 33])
def test_early_promotions_keep_every_counted_row_a_candidate(tmp_path, cap):
    """A short list of rows first read since the last promotion (as `FRESH_ROWS` = cap): promotions come inside a
    lookup as it fills; the bytes stay right, and the candidates stay distinct and exactly the rows with a count."""
    total, shard_rows, start, n = 3000, 700, 900, 1500
    table = _checkpoint(tmp_path, total, shard_rows, 0)
    rows = _rows(tmp_path, start, n, shard_rows, 60, refresh_every=50, promote_rows=5, staging_rows=16)
    rows._fresh = np.empty(cap, dtype=np.int64)
    rows.staging.state.fresh, rows.staging.state.fresh_cap = rows._fresh.ctypes.data, cap
    rng = np.random.default_rng(cap)
    for step in range(40):
        ids = rng.integers(start - 3, start + n + 3, int(rng.integers(0, 60)) * 4).astype(np.int64)
        got = rows.stage(torch.from_numpy(ids)).numpy()
        owned = (ids >= start) & (ids < start + n)
        assert (got[~owned] == -1).all()
        for part, want in table.items():
            assert np.array_equal(rows.staging.bytes[part][got[owned]], want[ids[owned]]), step
        candidates = _candidates(rows)
        assert np.unique(candidates).size == candidates.size and set(candidates.tolist()) == set(np.flatnonzero(rows.counts).tolist())
    assert rows.refreshes > 5
