"""`benchmarks/bench_file_tier.py` on a small table (CPU): every stream, budget and phase is reported against the
whole table, the lookups checked exact on the way; the calibration grows until every budget binds (resident rows ==
slots); the cold phase's misses read the drive (faulted in: its page-cache hit rate below the warm phase's, on files
just written; asked for after a fault: pages asked for, none warm); every phase of both tables measured for each
round; and the drive probe (`benchmarks.page_cache`) reports sane fields."""

import json
import sys

import numpy as np
import pytest

from benchmarks import bench_file_tier, page_cache


@pytest.mark.cpu_only
def test_the_benchmark_reports_every_budget_filled_and_the_cold_reads(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench", "--table-gb", "0.01", "--steps", "2", "--tokens", "16", "--calib-tokens",
                                      "2048", "--probe-reads", "64", "--ask-pages-first", "never", "after_a_fault",
                                      "--rounds", "2", "--disk-offload-reference", "--dir", str(tmp_path / "t"),
                                      "--out", str(out)])  # fmt: skip
    bench_file_tier.main()
    report = json.loads((out / "file_tier_cpu.json").read_text())
    tiered = [r for r in report["results"] if r["phase"] != "whole"]
    preadv = [r for r in tiered if r["ask_pages_first"] == bench_file_tier.DISK_OFFLOAD]
    tiered = [r for r in tiered if r not in preadv]
    assert {(r["stream"], r["share"], r["phase"], r["ask_pages_first"]) for r in tiered} == {
        (s, share, p, a) for s in ("uniform", "zipf1.1", "text") for share in bench_file_tier.SHARES for p in ("cold", "warm")
        for a in ("never", "after_a_fault")
    }
    # vLLM 0.34's reads, cold only: every owned row from the drive, none resident
    assert {(r["stream"], r["share"], r["phase"]) for r in preadv} == {
        (s, share, "cold") for s in ("uniform", "zipf1.1", "text") for share in bench_file_tier.SHARES}
    assert all(r["resident_hits"] == 0 and r["pages_needed"] > 0 and r["drive_read_bytes"] > 0 for r in preadv)
    assert all(len(r["s_rounds"]) == 2 and r["s_min"] <= r["s"] <= r["s_max"] for r in tiered)
    # 2 048 tokens hold fewer rows than the 50 % budget's slots: uniform filler makes up the rest, so every budget binds
    assert all(c["distinct_rows"] >= c["rows_needed"] > 0 and c["uniform_filler_tokens"] > 0 for c in report["calibration"].values())
    assert all(r["resident_rows"] == r["slots"] > 0 and r["vs_whole"] > 0 for r in tiered)
    full = [r for r in tiered if r["share"] == 1.0]
    assert all(r["resident_hits"] == 1.0 and r["pages_needed"] == 0 for r in full)
    for partial in (r for r in tiered if r["share"] < 1 and r["phase"] == "cold"):
        key = (partial["stream"], partial["share"], partial["ask_pages_first"])
        warm = next(r for r in tiered if r["phase"] == "warm" and (r["stream"], r["share"], r["ask_pages_first"]) == key)
        assert partial["pages_needed"] == warm["pages_needed"] > 0 and partial["drive_read_bytes"] > 0
        if partial["ask_pages_first"] == "never":
            assert partial["major_faults"] > 0 and partial["page_cache_hits"] < warm["page_cache_hits"], (partial, warm)
            assert partial["pages_asked"] == 0
        else:  # the first rows of a lookup fault, then the rest are asked for; cached, nothing is
            assert partial["major_faults"] > 0 and partial["pages_asked"] > 0 and warm["pages_asked"] == 0, (partial, warm)
    assert report["commit"] and report["drive"]["qd1"]["depth"] == 1 and report["drive"]["qd16"]["depth"] == 16
    assert (out / "file_tier_cpu.png").exists()


def test_the_drive_probe_reports_sane_fields(tmp_path):
    files = []
    for i, size in enumerate((1 << 20, 3 << 20, 100)):  # the last holds no whole block: never read
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8).tobytes())
    for depth in (1, 4):
        r = page_cache.random_read_rate(files, reads=64, depth=depth)
        assert (r["reads"], r["depth"], r["block"], r["bytes_spanned"]) == (64, depth, 4096, 4 << 20)
        assert r["iops"] > 0 and r["mb_per_s"] == pytest.approx(r["iops"] * 4096 / 1e6)
        assert isinstance(r["o_direct"], bool) and r["s"] > 0


def test_the_mapped_probe_reads_cold_pages_one_fault_each_or_all_asked_for_first(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes())
    for prefetch in (False, True):
        r = page_cache.mapped_read_rate([path], reads=32, prefetch=prefetch)
        assert (r["reads"], r["prefetch"]) == (32, prefetch) and r["pages_per_s"] > 0
        assert r["drive_read_bytes"] > 0  # the file's pages were dropped: the touches read the drive
        assert 0 < r["major_faults"] <= 32 if not prefetch else r["major_faults"] <= 32  # queued first: found in the cache


@pytest.mark.cpu_only
def test_preadv_rows_reads_the_rows_the_maps_hold(tmp_path):
    """`page_cache.PreadvRows` (vLLM 0.34's `disk_offload` reads, the file tier's reference): the bytes it reads for
    each distinct row and part are the row's bytes in the file, sorted by row, across shards."""
    from benchmarks.common import DIM, HEADS, bench_config, load_table, write_table
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec
    from qwen4_exp_hcu.ple.storage import PLEStorage
    from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
    from qwen4_exp_hcu.ple.tiers.file_rows import FileTier

    spec = NgramHashSpec.from_config(bench_config(20_000, HEADS // 2, DIM), 0)
    shard_rows = -(-spec.rows // 4)
    write_table(tmp_path, spec.rows, shard_rows)
    table = load_table(tmp_path, spec.rows, shard_rows, PLEStorage("int8", host=True, file_tier=FileTier(CheckpointFiles(tmp_path), 0)))
    shards = table.file_rows.shards
    rows = np.random.default_rng(0).integers(0, spec.rows, 300)
    rows[:3] = (0, shard_rows - 1, spec.rows - 1)  # both ends of a shard and the table's last row
    reader = page_cache.PreadvRows(shards)
    n = np.unique(rows).size
    out = {part: np.zeros((n, size), dtype=np.uint8) for part, size in shards.row_bytes.items()}
    got = reader.read(rows, out)
    reader.close()
    assert np.array_equal(got, np.unique(rows))
    assert shards.in_memory == ["weight_scale"] and set(reader.buf) == {"weight"}  # vLLM's FP8 rows have no scales
    for part in reader.buf:
        want = np.stack([shards.maps[int(r // shard_rows)][part][int(r % shard_rows)] for r in got])
        assert np.array_equal(out[part], want), part
