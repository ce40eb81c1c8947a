"""`benchmarks/bench_file_promotions.py` on a small table (it runs on the CPU, where its figures were measured):
both caps run every phase, and the capped promotions and hot-row refresh read at most their cap."""

import json
import sys

import pytest

from benchmarks import bench_file_promotions


@pytest.mark.cpu_only
def test_the_benchmark_reports_both_caps(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench", "--table-gb", "0.02", "--prefill", "512", "--decode", "1", "4",
                                      "--steps", "300", "--hot-rows-share", "0.5", "--dir", str(tmp_path / "t"), "--out", str(out)])  # fmt: skip
    monkeypatch.setattr(bench_file_promotions, "REFRESH_ROWS", 100)  # the prefill's 8 k ids exceed it
    bench_file_promotions.main()
    report = json.loads((out / "file_promotions.json").read_text())
    phases = {(r["cap"], r["phase"]) for r in report["results"]}
    assert phases == {(c, p) for c in bench_file_promotions.CAPS for p in ("prefill 512", "decode b=1", "decode b=4")}
    assert all(r["promotions"] == 1 for r in report["results"] if r["phase"].startswith("decode"))
    uncapped, capped = report["hot_row_refresh"]
    assert capped["copied"] == 100 < uncapped["copied"]
    assert (out / "file_promotions.png").exists()
