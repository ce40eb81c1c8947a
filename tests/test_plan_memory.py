"""`benchmarks/plan_memory.py --host-ram-gib`: what `host_table_gib` to set for a node's RAM at the release's table,
and the decode speed the committed serving results measured at that share (or a note that none did)."""

from pathlib import Path

import pytest

from benchmarks import plan_memory
from benchmarks.plan_memory import GIB, RESULTS, expected_decode, file_tier_host_bytes, largest_budget, measured_decode

RELEASE = str(Path(__file__).resolve().parents[1] / "configs" / "release_config.json")
ROW = 160 + 2  # the release's INT8 row and its bf16 scale


@pytest.fixture(scope="module")
def measured():
    return measured_decode()


def _plans(ram_gib: float, measured) -> dict[tuple[int, int], dict]:
    cfg = plan_memory.load_config(RELEASE, 1)
    rows = plan_memory.plan(cfg, 256, host_ram_bytes=ram_gib * GIB, measured=measured)
    return {(r["tp"], r["dp"]): r for r in rows if not r["embedding_across_dp"]}


def test_the_committed_serving_results_are_read_with_their_files_and_slots(measured):
    assert {m["share"] for m in measured} >= {0.05, 0.2, 0.5, 1.0}
    for m in measured:
        assert (RESULTS / m["file"]).exists() and (RESULTS / m["whole_table_file"]).exists()
        assert set(m["decode_vs_whole_table"]) == set(m["decode_tokens_per_s"]) and m["table_rows"] > 0
        resident, slots = m["resident_slots"]
        assert 0 < resident <= slots and (resident == slots or m["share"] < 1)
    cold = [m for m in measured if m["cold_reads"]]  # against the pinned table's engine of the same cold-read run
    assert cold and all(m["calibrated"] and m["whole_table_file"] == m["file"] for m in cold)


def test_ram_that_holds_the_table_sets_no_budget(measured):
    advice = _plans(512, measured)[1, 1]["host_ram"]
    assert advice["whole_table_fits"] and "host_table_gib" not in advice


@pytest.mark.parametrize("ram_gib", [32, 12])
def test_a_smaller_ram_gets_the_largest_budget_that_fits(ram_gib, measured):
    """TP1, one rank a node: the budget's resident rows, staging and row maps fit the RAM, a row more per layer
    would not; a calibrated start (no counts) fits more; the share is read against the measured shares."""
    row = _plans(ram_gib, measured)[1, 1]
    advice = row["host_ram"]
    assert not advice["whole_table_fits"] and advice["ranks_on_node"] == 1
    per_layer, staging = [row["int8_table_bytes_per_rank"] // ROW], 8192 * 16
    for traffic in (True, False):
        best = largest_budget(ram_gib * GIB, per_layer, ROW, staging, traffic)
        assert file_tier_host_bytes(per_layer, ROW, best, staging, traffic) <= ram_gib * GIB
        assert file_tier_host_bytes(per_layer, ROW, best + ROW, staging, traffic) > ram_gib * GIB
        gib = advice["host_table_gib" if traffic else "host_table_gib_calibrated"]
        assert gib * GIB <= best < (gib + 0.01) * GIB
    assert 0 < advice["host_table_gib"] < advice["host_table_gib_calibrated"]
    share = advice["resident_share"]
    assert 0 < share < 1
    expected = advice["expected_decode"]
    assert not expected["measured"] and f"{share:.1%}" in expected["note"]  # none measured at that exact share
    bound = {m["share"] for m in measured if m["resident_slots"][0] == m["resident_slots"][1]}
    below = max((s for s in bound if s < share), default=None)
    assert {m["share"] for m in expected["nearest_below"]} == ({below} if below else set())
    assert expected["drive_bound"]["share_measured"] == max(s for s in (0.05, 0.2) if s <= share)  # cold lookups


def test_a_measured_share_is_reported_as_measured_and_ram_too_small_for_the_maps_gets_none(measured):
    at = expected_decode(0.2, measured)
    assert at["measured"] and {m["share"] for m in at["measured"]} == {0.2}
    assert all(m["resident_slots"][0] == m["resident_slots"][1] for m in at["measured"])  # runs whose budget bound
    assert any(m["share"] == 0.2 and m["resident_slots"][0] < m["resident_slots"][1] for m in measured)  # left out
    assert expected_decode(0.01, measured) == {"measured": [], "note": "no GPU measurement with the budget bound at 1.0% "
                                               "of the table yet", "nearest_below": [], "drive_bound": None}
    advice = _plans(1, measured)[1, 1]["host_ram"]
    assert advice["host_table_gib"] is None and advice["expected_decode"] is None


def test_the_drive_bound_adds_each_steps_missed_pages_at_the_measured_rate(tmp_path):
    """`drive_bound_decode`: a token's missed pages at the nearest cold-lookup share at or below the budget, read at
    the rate the tier reached there, added to every pinned decode step once per PLE layer; vLLM's reads beside the
    tier's in the same file are not the tier's."""
    import json

    def lookup(share, ask, pages, staging_s, hits=0.5):
        return {"stream": "text", "share": share, "phase": "cold", "ask_pages_first": ask, "pages_needed": pages,
                "staging_s": staging_s, "resident_hits": hits}  # fmt: skip

    lookups = {"steps": 2, "tokens_per_step": 4, "machine": {"device": "GPU"},
               "results": [lookup(0.2, "after_a_fault", 20, 0.001), lookup(0.2, "vllm_disk_offload", 80, 0.1),
                           lookup(0.05, "after_a_fault", 30, 0.001)]}  # fmt: skip
    pinned = {"results": {plan_memory.PINNED_DECODE[1]: {"decode_tokens_per_s": {"1": 100.0, "32": 1000.0}}}}
    for name, doc in ((plan_memory.DRIVE_LOOKUPS, lookups), (plan_memory.PINNED_DECODE[0], pinned)):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(doc))
    drive = plan_memory.drive_bound_decode(0.5, ple_layers=2, results=tmp_path)
    text = drive["streams"]["text"]
    assert drive["share_measured"] == 0.2 and text["pages_per_token"] == 2.5 and text["pages_per_s"] == pytest.approx(10_000)
    step = {"1": 0.01, "32": 0.032}  # the pinned steps; each adds b x 2.5 pages x 2 layers at 10 k pages/s
    assert text["decode_vs_whole_table"] == pytest.approx({b: s / (s + int(b) * 5 / 10_000) for b, s in step.items()})
    assert plan_memory.drive_bound_decode(0.05, results=tmp_path)["streams"]["text"]["pages_per_token"] == 3.75
    assert plan_memory.drive_bound_decode(0.04, results=tmp_path) is None
