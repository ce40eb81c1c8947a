"""vLLM 0.33 on a GPU: every CUDA-graph mode x PLE prefetch on/off against transformers' logprobs.

The tiny INT8 checkpoint with its PLE tables in pinned host memory (vLLM's `EngramConfig` default), served
in breakable CUDA graphs (vLLM's default for Qwen4Exp), FULL_AND_PIECEWISE and PIECEWISE (torch.compile,
breakable graphs off), FULL_DECODE_ONLY, eager, and breakable graphs with the opt-in hot-row cache
refreshed from the served traffic. Each engine runs the CPU suite's scenarios
(`helpers/scenarios.py`: chunked prefill, EOS inside prompts, one request at a time, a concurrent batch of
different lengths, 32 decode steps, a prefix-cache hit) in its own process (`vllm_gpu_worker.py`); several
share the GPU at once. One more engine runs with the PLE state carry broken on purpose and must fail the
same comparison, which shows the tolerance is sensitive to PLE state faults; further engines read every PLE
row 10 % too large (`helpers.faults.ROW_ERROR`, the row fault the bounds are set against) and must fail their mode's
bounds, and the torch.compile modes run once more with Inductor's `emulate_precision_casts`, where they give eager's
figures: their larger errors are the rounding of Inductor's fused kernels.

Runs unchanged on a machine with vLLM 0.33 installed, or through `../shared/gpu-vllm`:
`source .gpu-vllm/setup.sh && python3 -m pytest -s -m "gpu and vllm" tests/test_vllm_gpu.py`
(add `--results-dir benchmarks/results` to write the table of modes as `vllm_gpu_modes.json`).
"""

import functools
import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers.faults import ROW_ERROR
from helpers.scenarios import (
    COMPILED, MAX_NEW_TOKENS, PREFIX, PROMPTS, REPEAT, TINY, Tolerance, logprob_errors, prefix_prompt, repeat_errors,
)  # fmt: skip
from qwen4_exp_hcu.tiny import dequantized_checkpoint, make_tiny_int8_checkpoint, reference_greedy
from vllm_gpu_worker import MODES

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

WORKER = Path(__file__).with_name("vllm_gpu_worker.py")
PARALLEL_ENGINES = 4
TIMEOUT_S = 900
# (mode, prefetch, variant): the variants are the worker's flags; "" is the clean run
VARIANTS = {"": [], "state_fault": ["--fault"], "rows_fault": ["--rows-fault", str(ROW_ERROR)],
            "emulated": ["--emulate-precision-casts"],
            "emulated_rows_fault": ["--emulate-precision-casts", "--rows-fault", str(ROW_ERROR)]}  # fmt: skip
FAULT_RUN = ("breakable", True, "state_fault")
ROWS_FAULT_MODES = ("eager", "breakable", "full_decode_only", "full_and_piecewise", "full_and_piecewise-emulated")
COMPILED_MODES = ("full_and_piecewise", "piecewise")
EXPECTED_CUDAGRAPH_MODE = {
    "breakable": "FULL_AND_PIECEWISE",  # vLLM's default mode, captured as breakable graphs
    "full_and_piecewise": "FULL_AND_PIECEWISE",
    "piecewise": "PIECEWISE",
    "full_decode_only": "FULL_DECODE_ONLY",
    "eager": "NONE",
    "hot_rows": "FULL_AND_PIECEWISE",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_int8_checkpoint(tmp_path_factory.mktemp("gpu") / "int8")


def selected_runs(items) -> list:
    """The engines the selected tests of this module wait for (`-k hot_rows` starts two, not thirteen)."""
    keys = []
    for item in items:
        if getattr(item, "module", None) is None or item.module.__name__ != __name__:
            continue
        if item.originalname == "test_broken_state_carry_is_caught":
            keys.append(FAULT_RUN)
        elif item.originalname == "test_graph_mode_matches_transformers":
            keys.append((item.callspec.params["mode"], item.callspec.params["prefetch"], ""))
        elif item.originalname == "test_rows_off_are_caught":
            keys.append(rows_fault_run(item.callspec.params["mode"]))
        elif item.originalname == "test_compiled_modes_with_emulated_casts":
            keys.append((item.callspec.params["mode"], True, "emulated"))
    return keys


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory, request):
    """Start the selected tests' engines (a few at a time, in the background); each test waits for its own."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("runs")

    def run(key):
        mode, prefetch, variant = key
        name = f"{mode}-{'prefetch' if prefetch else 'noprefetch'}{'-' + variant if variant else ''}"
        cmd = [sys.executable, str(WORKER), str(checkpoint), str(out / f"{name}.json"), "--mode", mode]
        cmd += ([] if prefetch else ["--no-prefetch"]) + VARIANTS[variant]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_BREAKABLE_CUDAGRAPH"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            return {"error": f"{name} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"}
        return json.loads((out / f"{name}.json").read_text())

    pool = ThreadPoolExecutor(PARALLEL_ENGINES)
    futures = {key: pool.submit(run, key) for key in selected_runs(request.session.items)}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)  # a run stopped early (`--budget-s`) starts no more engines


@pytest.fixture(scope="module")
def reference(checkpoint, runs, tmp_path_factory):
    """transformers (fp32) on the dequantized tables, computed while the engines start (the cache-hit prompt's
    once an engine has said its block size)."""
    dequantized = dequantized_checkpoint(checkpoint, tmp_path_factory.mktemp("gpu") / "dequantized")
    return references(dequantized)


def references(oracle) -> dict:
    """transformers' answers on `oracle`: PROMPTS', and the cache-hit prompt's for an engine's block size
    (`prefix(block_size)`)."""
    prefix = functools.cache(lambda block_size: reference_greedy(oracle, [prefix_prompt(block_size)], 8)[0])
    return {"prompts": reference_greedy(oracle, PROMPTS, MAX_NEW_TOKENS), "prefix": prefix}


@pytest.fixture
def record(modes_file, record_property):
    """One engine's row: into `vllm_gpu_modes.json`, and as the test's own figures (`--test-records`)."""

    def add(row: dict):
        modes_file(row)
        for name in ("cudagraph_mode", "mean", "max", "prefix_mean", "prefix_max", "repeat_max", "within_tolerance",
                     "startup_s"):
            record_property(name, row[name])

    return add


@pytest.fixture(scope="module")
def modes_file(results_dir):
    """Collects one row per engine; written as `vllm_gpu_modes.json` when `--results-dir` is given, replacing
    the rows of the engines that ran and keeping the others (a `-k` run updates its rows only)."""
    rows = []
    yield rows.append
    if results_dir is None or not rows:
        return
    import triton
    import vllm

    results_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python3 -m pytest -s -m 'gpu and vllm' tests/test_vllm_gpu.py --results-dir benchmarks/results",
        "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
                    "triton": triton.__version__, "vllm": vllm.__version__},
        "checkpoint": "tiny INT8 (qwen4_exp_hcu.tiny), PLE tables in pinned host memory",
        "metric": "|vLLM - transformers fp32 on the dequantized tables| over the top-5 logprobs of every step; "
        "worst scenario (one at a time, concurrent batch, prefix-cache hit)",
        "tolerance": {mode: {"mean": tolerance(mode).mean, "max": tolerance(mode).max} for mode in MODES},
        "prefix_tolerance": {"mean": PREFIX.mean, "max": PREFIX.max, "note": "at least, for the cache-hit prompt (the engine's first cache block + 3 tokens)"},
        "repeat_tolerance": {"mean": REPEAT.mean, "max": REPEAT.max, "note": "at least, its cache hit against its miss"},
    }
    path = results_dir / "vllm_gpu_modes.json"

    def key(r):
        return list(VARIANTS).index(r["variant"]), list(MODES).index(r["mode"]), not r["prefetch"]

    kept = json.loads(path.read_text())["runs"] if path.exists() else []
    ran = {key(r) for r in rows}
    doc["runs"] = sorted([r for r in kept if key(r) not in ran] + rows, key=key)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def compare(result, reference) -> dict:
    """Per scenario: greedy tokens equal? and the top-5 logprob errors (mean, max) over its requests; for the
    prefix-cache hit also against the same prompt's miss (`prefix_repeat`)."""
    cases = {
        "one_at_a_time": zip(result["one_at_a_time"], reference["prompts"]),
        "concurrent": zip(result["concurrent"], reference["prompts"]),
        "prefix_cache": zip(result["prefix_cache"], [reference["prefix"](result["block_size"])] * 2),
    }
    report = {}
    for name, pairs in cases.items():
        pairs = list(pairs)
        errors = torch.cat([logprob_errors(out["logprobs"], ref["logprobs"]) for out, ref in pairs])
        report[name] = {
            "tokens_equal": all(out["tokens"] == ref["tokens"] for out, ref in pairs),
            "mean": errors.mean().item(),
            "max": errors.max().item(),
        }
    miss, hit = result["prefix_cache"]
    errors = repeat_errors(hit["logprobs"], miss["logprobs"])
    report["prefix_repeat"] = {"tokens_equal": hit["tokens"] == miss["tokens"], "mean": errors.mean().item(),
                               "max": errors.max().item()}  # fmt: skip
    return report


def tolerance(mode: str, variant: str = "") -> Tolerance:
    """Each mode's own bounds (`helpers.scenarios`): torch.compile's modes sit higher than the eager-like ones,
    unless Inductor emulates eager's rounding."""
    return COMPILED if mode in COMPILED_MODES and not variant.startswith("emulated") else TINY


def rows_fault_run(mode: str) -> tuple:
    """The row fault's engine for `mode` (a compiled mode under default Inductor, where `COMPILED` applies, or
    `MODE-emulated`: with eager's rounding, where `TINY` applies)."""
    mode, _, emulated = mode.partition("-")
    return (mode, True, "emulated_rows_fault" if emulated else "rows_fault")


def within_tolerance(report, tol: Tolerance) -> bool:
    """Every scenario within `tol`; the cache-hit prompt against transformers within `PREFIX` at least (its
    bf16 noise, see `helpers.scenarios`), its cache hit against its miss within `REPEAT` at least."""
    floors = {"prefix_cache": PREFIX, "prefix_repeat": REPEAT}

    def bound(name: str) -> Tolerance:
        floor = floors.get(name, tol)
        return Tolerance(max(tol.mean, floor.mean), max(tol.max, floor.max))

    return all(r["tokens_equal"] and r["mean"] < bound(n).mean and r["max"] < bound(n).max for n, r in report.items())


def summary(key, result, report, record) -> str:
    """One printed line per engine (the worst of the short prompts, then the prefix prompt and its cache hit
    against its miss, which have bounds of their own); the same figures go to `record`."""
    short = [report["one_at_a_time"], report["concurrent"]]
    worst_mean, worst_max = max(r["mean"] for r in short), max(r["max"] for r in short)
    prefix, repeat = report["prefix_cache"], report["prefix_repeat"]
    record({
        "mode": key[0], "prefetch": key[1], "variant": key[2], "cudagraph_mode": result["cudagraph_mode"],
        "breakable": result["breakable"], "compile": result["compilation_mode"], "mean": round(worst_mean, 4),
        "max": round(worst_max, 4), "prefix_mean": round(prefix["mean"], 4), "prefix_max": round(prefix["max"], 4),
        "repeat_max": round(repeat["max"], 4), "tokens_equal": all(r["tokens_equal"] for r in report.values()),
        "within_tolerance": within_tolerance(report, tolerance(key[0], key[2])), "startup_s": result["startup_s"],
    })  # fmt: skip
    return (
        f"GPU-PARITY {key[0]:<18} prefetch={'on ' if key[1] else 'off'} {key[2] or 'clean':<11} "
        f"graphs={result['cudagraph_mode']}{' (breakable)' if result['breakable'] else ''} "
        f"compile={result['compilation_mode']} logprob err mean {worst_mean:.4f} max {worst_max:.4f} "
        f"prefix {prefix['mean']:.4f} / {prefix['max']:.4f} hit-vs-miss max {repeat['max']:.4f} "
        f"tokens_equal={all(r['tokens_equal'] for r in report.values())} startup {result['startup_s']} s"
    )


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
@pytest.mark.parametrize("mode", list(MODES))
def test_graph_mode_matches_transformers(mode, prefetch, runs, reference, record):
    result = runs[(mode, prefetch, "")].result()
    assert "error" not in result, result.get("error")
    report = compare(result, reference)
    print(summary((mode, prefetch, ""), result, report, record))
    if mode != "eager":  # vLLM turns the flag on for our architecture even when enforce_eager makes it moot
        assert result["breakable"] == (mode in ("breakable", "hot_rows"))
    assert result["cudagraph_mode"] == EXPECTED_CUDAGRAPH_MODE[mode]
    assert within_tolerance(report, tolerance(mode)), report
    first, second = result["prefix_cache"]
    assert second["num_cached_tokens"] > first["num_cached_tokens"], "no prefix-cache hit"
    for table in result["tables"]:
        assert (table["device"], table["pinned"], table["dtype"]) == ("cpu", True, "int8"), table
        hot = table["hot_rows"]
        assert (hot is not None) == (mode == "hot_rows"), table
        if hot is not None:  # the cache was refreshed from the traffic while the answers stayed exact
            assert hot["refreshes"] > 0 and hot["filled"] > 0, hot


def test_broken_state_carry_is_caught(runs, reference, record):
    """The same comparison on an engine whose PLE layers never carry state across steps must fail."""
    result = runs[FAULT_RUN].result()
    assert "error" not in result, result.get("error")
    report = compare(result, reference)
    print(summary(FAULT_RUN, result, report, record))
    assert not within_tolerance(report, tolerance(FAULT_RUN[0])), report


@pytest.mark.parametrize("mode", ROWS_FAULT_MODES)
def test_rows_off_are_caught(mode, runs, reference, record):
    """Every PLE row read 10 % too large (`helpers.faults.scale_table_rows`): the row fault each mode's tolerance
    must catch."""
    key = rows_fault_run(mode)
    result = runs[key].result()
    assert "error" not in result, result.get("error")
    report = compare(result, reference)
    print(summary(key, result, report, record))
    assert not within_tolerance(report, tolerance(*key[::2])), report


@pytest.mark.parametrize("mode", COMPILED_MODES)
def test_compiled_modes_with_emulated_casts(mode, runs, reference, record):
    """torch.compile with Inductor rounding as eager does (`emulate_precision_casts`): the compiled modes' larger
    errors are fused-kernel rounding, so here they fall to the eager-like modes' bounds (H200: eager's 0.0069 / 0.05,
    `benchmarks/results/vllm_gpu_modes.json`)."""
    key = (mode, True, "emulated")
    result = runs[key].result()
    assert "error" not in result, result.get("error")
    report = compare(result, reference)
    print(summary(key, result, report, record))
    assert within_tolerance(report, tolerance(mode, key[2])), report
