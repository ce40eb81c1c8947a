"""`benchmarks/bench_file_tier.py` on a small table (CPU): every stream and budget is reported against the whole
table, the lookups checked exact on the way, and the resident rows never exceed the budget's slots; where the
calibration holds fewer rows than the slots, the report shows it (the budget did not bind)."""

import json
import sys

import pytest

from benchmarks import bench_file_tier


@pytest.mark.cpu_only
def test_the_benchmark_reports_every_budget_and_what_it_kept(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench", "--table-gb", "0.01", "--steps", "2", "--tokens", "16", "--calib-tokens",
                                      "2048", "--dir", str(tmp_path / "t"), "--out", str(out)])  # fmt: skip
    bench_file_tier.main()
    results = json.loads((out / "file_tier_cpu.json").read_text())["results"]
    tiered = [r for r in results if r["phase"] != "whole"]
    assert {(r["stream"], r["share"], r["phase"]) for r in tiered} == {
        (s, share, p) for s in ("uniform", "zipf1.1", "text") for share in bench_file_tier.SHARES for p in ("cold", "warm")
    }
    assert all(0 < r["resident_rows"] <= r["slots"] and r["vs_whole"] > 0 for r in tiered)
    full = [r for r in tiered if r["share"] == 1.0]
    assert all(r["resident_rows"] == r["slots"] and r["resident_hits"] == 1.0 for r in full)
    assert any(r["resident_rows"] < r["slots"] for r in tiered)  # 2 048 tokens leave the 50 % budget unfilled
    assert (out / "file_tier_cpu.png").exists()
