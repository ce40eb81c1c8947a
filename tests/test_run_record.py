"""`--results-dir` leaves one record of the run: each test's outcome, with the reason where it did not pass."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = '''
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("no accelerator here")
'''


def test_a_run_leaves_its_record(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    results = tmp_path / "results"
    tests_dir = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")]),
           "QWEN4_EXP_HCU_COMMIT": "abc123"}  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "helpers.run_record",
                          "--results-dir", str(results), str(tmp_path / "test_sample.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed
    (record,) = results.glob("suite_vllm-*.json")
    doc = json.loads(record.read_text())
    assert doc["commit"] == "abc123" and doc["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    tests = {name.split("::")[-1]: t for name, t in doc["tests"].items()}
    assert tests["test_passes"]["outcome"] == "passed" and "message" not in tests["test_passes"]
    assert tests["test_fails"]["outcome"] == "failed" and "one is not two" in tests["test_fails"]["message"]
    assert tests["test_skips"]["outcome"] == "skipped" and "no accelerator here" in tests["test_skips"]["message"]
    assert "--results-dir" in doc["command"] and record.name.startswith(f"suite_vllm-{doc['vllm']}_")
