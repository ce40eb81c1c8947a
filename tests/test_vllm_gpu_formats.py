"""vLLM 0.33 on a GPU, in its default breakable CUDA graphs: PLE tables in upstream's FP8 (bf16 and fp32 table
scale) and NVFP4 layouts, in pinned host memory, against transformers on their dequantized rows.

The same scenarios as `test_vllm_gpu.py` (chunked prefill, EOS in prompts, a concurrent batch, a prefix-cache
hit) within the `TABLE_FORMATS` tolerance (`helpers.scenarios`), one engine process per checkpoint (`vllm_gpu_worker.py`), run two at a time.

    source .gpu-vllm/setup.sh && python3 -m pytest -s tests/test_vllm_gpu_formats.py
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.checkpoints import upstream_table_checkpoints
from helpers.scenarios import TABLE_FORMATS
from qwen4_exp_hcu.tiny import make_tiny_checkpoint
from test_vllm_gpu import TIMEOUT_S, WORKER, compare, references, within_tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

VARIANTS = {  # name: (format, fp8 table-scale dtype), with the stored weight dtype the engine must report
    "fp8-bf16-scale": ("fp8", torch.bfloat16, "float8_e4m3fn"),
    "fp8-fp32-scale": ("fp8", torch.float32, "float8_e4m3fn"),
    "nvfp4": ("nvfp4", None, "uint8"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Per variant: the engine's result (started in the background) and the transformers reference."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("formats")
    bf16 = make_tiny_checkpoint(root / "bf16")

    def run(name, checkpoint):
        out = root / f"{name}.json"
        env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_BREAKABLE_CUDAGRAPH"}
        cmd = [sys.executable, str(WORKER), str(checkpoint), str(out), "--mode", "breakable"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        if proc.returncode != 0:
            return {"error": f"{name} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"}
        return json.loads(out.read_text())

    pool = ThreadPoolExecutor(2)
    runs, oracles = {}, {}
    for name, (fmt, scale_dtype, _) in VARIANTS.items():
        checkpoint = upstream_table_checkpoints(bf16, root / name, root / f"{name}-oracle", fmt, scale_dtype)
        runs[name], oracles[name] = pool.submit(run, name, checkpoint), root / f"{name}-oracle"
    answers = {name: references(o) for name, o in oracles.items()}
    yield {name: (runs[name], answers[name]) for name in VARIANTS}
    pool.shutdown(wait=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_upstream_table_layouts_in_breakable_graphs(variant, served, record_property):
    future, reference = served[variant]
    result = future.result()
    assert "error" not in result, result.get("error")
    report = compare(result, reference)
    worst = {k: max(r[k] for r in report.values()) for k in ("mean", "max")}
    record_property("graph_mode", "breakable")
    for name, value in worst.items():
        record_property(name, round(value, 4))
    print(f"GPU-FORMAT {variant:<15} graphs={result['cudagraph_mode']} breakable={result['breakable']} "
          f"logprob err mean {worst['mean']:.4f} max {worst['max']:.4f} tables={[t['describe'] for t in result['tables']]}")  # fmt: skip
    assert result["breakable"] and result["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert within_tolerance(report, TABLE_FORMATS), report
    for table in result["tables"]:
        assert (table["device"], table["pinned"], table["dtype"]) == ("cpu", True, VARIANTS[variant][2]), table
