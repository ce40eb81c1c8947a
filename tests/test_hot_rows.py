"""The hot-row cache (`tiers.hot_rows.HotRows`): after any sequence of traffic, refreshes and calibration fills,
the fused lookup through the cache equals the table's reference bit for bit, the cache holds exactly the
most counted rows, and its map and slots agree. The kernel runs under the Triton interpreter on the CPU
(conftest); `test_table.py` runs a host table with a cache on the GPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from qwen4_exp_hcu.kernels.gather_dequant import BF16, INT8, gather_dequant, gather_dequant_reference
from qwen4_exp_hcu.ple.formats.int8 import quantize_rows
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows, load_calibration_tokens

D = 16
cpu_only = pytest.mark.cpu_only  # the kernel over CPU tensors runs under the interpreter, where no GPU is


def table(n: int, fmt: str, g: torch.Generator):
    w = torch.randn(n, D, generator=g).to(torch.bfloat16)
    return quantize_rows(w) if fmt == "int8" else (w, None)


def zipf_ids(n: int, t: int, g: torch.Generator, shift: int) -> torch.Tensor:
    """[t, 2] ids in [-3, n + 3) skewed towards a few of them (which ones moves with `shift`)."""
    ranks = torch.arange(1, n + 7, dtype=torch.float64).pow(-1.2)
    return ((torch.multinomial(ranks, 2 * t, True, generator=g) + shift) % (n + 6) - 3).view(t, 2)


def reference(ids, w, s, start):
    return gather_dequant_reference(ids, w, s, start, kind=BF16 if s is None else INT8)


def through_cache(ids, w, s, start, hot):
    out = torch.full((ids.shape[0], ids.shape[1] * D), float("nan"), dtype=torch.bfloat16)
    return gather_dequant(ids, w, s, start, out, kind=BF16 if s is None else INT8, cache=hot.tensors)


def check_consistent(hot: HotRows, w, s):
    filled = (hot.slot_row >= 0).nonzero().flatten()
    assert torch.equal(hot.map[hot.slot_row[filled]], filled.int())  # slot -> row -> the same slot
    assert int((hot.map >= 0).sum()) == filled.numel()  # no stale map entries
    assert torch.equal(hot.rows[filled], w[hot.slot_row[filled]])
    if s is not None:
        assert torch.equal(hot.row_scales[filled], s[hot.slot_row[filled]])


@cpu_only
@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(["bf16", "int8"]),
    n=st.integers(4, 120),
    slots=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
    steps=st.integers(1, 12),
)
def test_lookups_through_a_refreshing_cache_are_exact(fmt, n, slots, seed, steps):
    """Traffic whose hot rows drift step by step, refreshed every 2 lookups: every lookup is exact and
    each refresh caches the rows with the highest counts (the newcomer cap does not bind here)."""
    g = torch.Generator().manual_seed(seed)
    w, s = table(n, fmt, g)  # this rank's rows [start, start + n) of a table of n + 10 rows
    start = 5
    hot = HotRows(w, s, start, slots, "cpu", observe=True)
    hot.refresh_every = 2
    for step in range(steps):
        ids = zipf_ids(n + 10, 30, g, shift=3 * step)
        before = hot.counts.clone()
        hot.observe(ids)
        got = through_cache(ids, w, s, start, hot)
        assert torch.equal(got, reference(ids, w, s, start))
        if step % 2 == 1:  # refreshed from the counts after this lookup, then halved
            local = ids.flatten() - start
            counted = before + torch.bincount(torch.where((local >= 0) & (local < n), local, n), minlength=n + 1).int()
            assert torch.equal(hot.counts, counted >> 1)
            k = min(slots, int((counted[:-1] > 0).sum()))
            cached = hot.slot_row[hot.slot_row >= 0]
            threshold = counted[:-1].topk(k).values.min() if k else 0
            assert int((counted[cached] >= threshold).sum()) >= k  # the top k (ties aside); others only in spare slots
        check_consistent(hot, w, s)
    assert hot.refreshes == steps // 2


def test_a_refresh_copies_at_most_refresh_rows_and_evicts_only_for_newcomers():
    """After a long prefill every row it read is counted; a refresh copies the `refresh_rows` most counted
    newcomers, and later refreshes bring the rest. A newcomer takes an empty slot, else the least counted
    cached row outside the top; cached rows nobody displaces stay (they may still be read)."""
    w, s = table(100, "int8", torch.Generator().manual_seed(0))
    hot = HotRows(w, s, 0, 4, "cpu", observe=True)
    hot.refresh_every, hot.refresh_rows = 1, 2
    hot.observe(torch.tensor([[0, 0], [0, 1], [1, 2], [3, 9]]))  # counts 0:3, 1:2, 2:1, 3:1, 9:1
    assert sorted(hot.slot_row[hot.slot_row >= 0].tolist()) == [0, 1]  # the two most counted
    assert hot.share == pytest.approx(5 / 8)
    counts = torch.zeros(100, dtype=torch.int32)
    counts[[0, 1, 2, 3]] = torch.tensor([5, 4, 3, 2], dtype=torch.int32)
    hot.refresh(counts, 2)
    assert sorted(hot.slot_row.tolist()) == [0, 1, 2, 3]
    slot_of = {int(r): i for i, r in enumerate(hot.slot_row)}
    counts[:] = 0
    counts[[10, 11, 0, 1, 3]] = torch.tensor([9, 8, 5, 4, 1], dtype=torch.int32)
    hot.refresh(counts, 2)  # top: 10, 11, 0, 1; 2 (count 0) goes first, then 3 (count 1)
    assert {int(r): i for i, r in enumerate(hot.slot_row)} == {0: slot_of[0], 1: slot_of[1], 10: slot_of[2], 11: slot_of[3]}
    counts[:] = 0
    counts[10] = 3
    hot.refresh(counts)  # one row in the top, already cached: nothing leaves
    assert sorted(hot.slot_row.tolist()) == [0, 1, 10, 11]
    check_consistent(hot, w, s)


@cpu_only
def test_a_wrong_cached_row_is_caught():
    """The exactness check above reads cached rows: one corrupted slot changes the lookup."""
    g = torch.Generator().manual_seed(0)
    w, s = table(50, "int8", g)
    hot = HotRows(w, s, 0, 8, "cpu", observe=False)
    ids = zipf_ids(50, 40, g, shift=0).clamp(0, 49)
    hot.fill(ids)
    hot.rows[hot.map[ids[0]].long()] += 1
    assert not torch.equal(through_cache(ids, w, s, 0, hot), reference(ids, w, s, 0))


def test_calibration_fill_caches_the_most_frequent_rows_and_reports_their_share():
    w, s = table(8, "bf16", torch.Generator().manual_seed(0))
    hot = HotRows(w, s, 2, 2, "cpu", observe=False)
    ids = torch.tensor([3, 3, 3, 7, 7, 4, 0, 0, 0, 0, 11])  # 0 and 11 are not owned: not counted
    assert hot.fill(ids) == pytest.approx(5 / 6)
    assert sorted((hot.slot_row + 2).tolist()) == [3, 7]
    assert hot.counts is None  # a calibrated cache does not count traffic
    hot.observe(ids)
    assert hot.refreshes == 1


def test_budget_arithmetic():
    row = D + 2  # an INT8 row and its bf16 scale
    assert HotRows.bytes_needed(1000, 0, row, observe=False) == 4 * 1000
    assert HotRows.bytes_needed(1000, 10, row, observe=True) == 4 * 1000 + 4 * 1001 + 10 * (row + 8)
    assert HotRows.slots_for(4000 + 5 * (row + 8), 1000, row, observe=False) == 5
    assert HotRows.slots_for(10**9, 1000, row, observe=False) == 1000  # never more slots than rows
    assert HotRows.slots_for(3999, 1000, row, observe=False) < 1
    with pytest.raises(ValueError, match="at least one slot"):
        HotRows(torch.zeros(4, D), None, 0, 0, "cpu", observe=False)


def test_calibration_file_is_checked(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"tokens": torch.tensor([4, 1, 4, 9, 0], dtype=torch.int32)}, good)
    tokens = load_calibration_tokens(str(good), 10)
    assert tokens.dtype == torch.int64 and tokens.tolist() == [4, 1, 4, 9, 0]  # the stream as written, in order
    cases = {
        "no `tokens` tensor": {"ids": torch.tensor([1])},
        "1-D integer": {"tokens": torch.ones(2, 2, dtype=torch.int64)},
        r"\[0, 10\)": {"tokens": torch.tensor([3, 10])},
    }
    for message, tensors in cases.items():
        path = tmp_path / "bad.safetensors"
        save_file(tensors, path)
        with pytest.raises(ValueError, match=message):
            load_calibration_tokens(str(path), 10)
