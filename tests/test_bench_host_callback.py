"""`benchmarks/bench_host_callback.py` on a small table: every variant promotes once in the timed lookup (the
benchmark asserts it), the report names the switch interval each ran with, and the callback's own interval is
restored after the run."""

import json
import sys

import pytest

from benchmarks import bench_host_callback
from qwen4_exp_hcu.ple.tiers import host_call


@pytest.mark.cpu_only
def test_the_benchmark_reports_every_variant(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bench", "--table-gb", "0.01", "--tokens", "8", "--refresh-every", "4", "--repeats", "1",
                                      "--dir", str(tmp_path / "t"), "--out", str(out)])  # fmt: skip
    bench_host_callback.main()
    results = json.loads((out / "host_callback.json").read_text())["results"]
    assert list(results) == list(bench_host_callback.VARIANTS)
    assert results["busy thread, default interval"]["callback_switch_interval_s"] == sys.getswitchinterval()
    assert results["busy thread, guarded's interval"]["callback_switch_interval_s"] == host_call.CALLBACK_SWITCH_INTERVAL_S
    assert all(r["median_ms"] > 0 for r in results.values()) and (out / "host_callback.png").exists()
