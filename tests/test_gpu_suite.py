"""The GPU suite's runner on the CPU: one record per test (`helpers.records`), written as each test ends and kept
when a run is killed; `tools/gpu_suite.py` resuming where the last run stopped, the time budget, the table. Each
case runs pytest on a small test file of its own, in a subprocess."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers.run_record import ROOT, code_files, code_id, module_id, reach, release, shared_files

TESTS_DIR = Path(__file__).parent
TOOL = TESTS_DIR.parent / "tools" / "gpu_suite.py"
COMMIT = "abc1234def"

RAN = '''
from pathlib import Path

import pytest


def ran(name):
    with Path(__file__).with_name("ran.txt").open("a") as f:
        f.write(name + "\\n")
'''

FIGURES = RAN + '''

def test_passes(record_property):
    ran("passes")
    record_property("mean", 0.0069)
    record_property("within_tolerance", True)


@pytest.mark.parametrize("mode", ["breakable", "eager"])
def test_graph_mode(mode):
    ran(mode)


def test_names_its_graph_mode(record_property):
    record_property("graph_mode", "full_decode_only")


def test_fails():
    assert 1 == 2, "one is not two"


def test_skips():
    pytest.skip("no accelerator here")
'''

SUITE = RAN + '''
import os
import signal


@pytest.mark.gpu
def test_a():
    ran("a")


@pytest.mark.gpu
def test_killed():
    ran("killed")
    os.kill(os.getpid(), signal.SIGKILL)  # the machine's time limit, mid-test


@pytest.mark.gpu
def test_c():
    ran("c")


@pytest.mark.vllm
def test_d():
    ran("d")


def test_not_a_gpu_test():
    ran("cpu")


@pytest.mark.vllm
@pytest.mark.cpu_only
def test_cpu_only():
    ran("cpu_only")


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_two_gpus():
    ran("two_gpus")
'''

BUDGET = RAN + '''
import time


def test_1(request):
    ran("1")
    plugin = request.config.pluginmanager.get_plugin("test_records")
    while time.monotonic() - plugin.began <= plugin.budget_s:  # the budget is spent while this test runs
        time.sleep(0.05)


def test_2():
    ran("2")


def test_3():
    ran("3")
'''


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
            "QWEN4_EXP_HCU_COMMIT": COMMIT}  # fmt: skip


def pytest_run(tmp_path, source: str, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(source)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "helpers.records", *options,
           str(tmp_path / "test_sample.py")]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True)


def tool(tmp_path, *options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(TOOL), "--results", str(tmp_path / "results"), *options]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True)


def tool_run(tmp_path, *options: str) -> subprocess.CompletedProcess:
    """The tool on the sample suite (outside tests/, so the plugin comes by `-p`). Its root is the sample's folder:
    pytest would otherwise root it at the common ancestor of that folder and the checkout (e.g. /tmp), and name
    the tests from there."""
    plugins = ["-p", "helpers.run_record", "-p", "helpers.records", "--rootdir", str(tmp_path)]
    return tool(tmp_path, *options, "--", *plugins, str(tmp_path / "test_sample.py"))


def ran(tmp_path) -> list[str]:
    return (tmp_path / "ran.txt").read_text().split() if (tmp_path / "ran.txt").exists() else []


def records(directory: Path) -> dict[str, dict]:
    docs = [json.loads(p.read_text()) for p in directory.glob("*.json")]
    return {doc["nodeid"].split("::")[-1]: doc for doc in docs}


def test_each_test_leaves_its_record_with_its_figures(tmp_path):
    out = tmp_path / "results" / f"{code_id()}_{release()}" / "tests"
    run = pytest_run(tmp_path, FIGURES, "--test-records", str(out))
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed
    found = records(out)
    assert set(found) == {"test_passes", "test_graph_mode[breakable]", "test_graph_mode[eager]",
                          "test_names_its_graph_mode", "test_fails", "test_skips"}  # fmt: skip
    passes = found["test_passes"]
    assert passes["outcome"] == "passed" and "message" not in passes and passes["graph_mode"] is None
    assert passes["figures"] == {"mean": 0.0069, "within_tolerance": True}
    assert (passes["commit"], passes["code"], passes["vllm"], passes["device"]) == (COMMIT, code_id(), release(), "cpu")
    assert [name for name, r in found.items() if r["ran_first"]] == ["test_passes"]
    assert found["test_graph_mode[eager]"]["graph_mode"] == "eager"
    assert found["test_names_its_graph_mode"]["graph_mode"] == "full_decode_only"
    assert found["test_names_its_graph_mode"]["figures"] == {}
    assert found["test_fails"]["outcome"] == "failed" and "one is not two" in found["test_fails"]["message"]
    assert found["test_skips"]["outcome"] == "skipped" and "no accelerator here" in found["test_skips"]["message"]
    assert found["test_skips"]["reason"] == "Skipped: no accelerator here"

    table = tool(tmp_path, "--table", "--vllm", release())
    assert table.returncode == 0, table.stderr
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table.stdout.splitlines()[2:]}
    assert len(rows) == 6 and table.stdout.startswith("| test | outcome | graph mode | figures |")
    assert f"| passed | — | mean 0.0069; within_tolerance True | cpu | {COMMIT[:7]} | {release()} |" in rows[
        "`test_sample.py::test_passes`"]
    assert "| failed: AssertionError: one is not two |" in rows["`test_sample.py::test_fails`"]
    assert "| passed | eager | — |" in rows["`test_sample.py::test_graph_mode[eager]`"]


def test_the_suite_resumes_where_a_killed_run_stopped(tmp_path):
    """A killed run keeps the finished tests' records and its cut test's; the next runs skip what is recorded and
    run the cut test first; cut again as the first, it counts as finished."""
    out = tmp_path / "results" / f"{code_id()}_{release()}"
    (tmp_path / "test_sample.py").write_text(SUITE)
    first = tool_run(tmp_path)
    assert first.returncode == 128 + signal.SIGKILL, first.stdout + first.stderr
    assert ran(tmp_path) == ["a", "killed"]
    found = records(out / "tests")
    assert {name: (r["outcome"], r["ran_first"]) for name, r in found.items()} == {
        "test_a": ("passed", True), "test_killed": ("unfinished", False)}

    listed = tool_run(tmp_path, "--list")
    assert "1 of 4 tests recorded, 3 left: next test_sample.py::test_killed" in listed.stdout, listed.stdout
    assert ran(tmp_path) == ["a", "killed"]

    tool_run(tmp_path)
    assert ran(tmp_path) == ["a", "killed", "killed"]  # first this time, and cut again
    assert records(out / "tests")["test_killed"]["ran_first"]

    last = tool_run(tmp_path)
    assert last.returncode == 0, last.stdout + last.stderr
    assert ran(tmp_path) == ["a", "killed", "killed", "c", "d"]  # neither CPU tests nor multi-GPU ones
    assert set(records(out / "tests")) == {"test_a", "test_killed", "test_c", "test_d"}
    assert "4 of 4 tests recorded, 0 left" in last.stdout


def test_the_summary_counts_current_records_against_the_suite(tmp_path):
    """summary.json: the suite's tests with a finished record made with their module as it is now, outcomes per
    module, why a test did not pass, what is left, the multi-GPU tests apart; TESTS.md: the table beside it."""
    out = tmp_path / "results" / f"{code_id()}_{release()}"
    (tmp_path / "test_sample.py").write_text(SUITE.replace("os.kill(os.getpid(), signal.SIGKILL)", "pytest.skip('no')"))
    assert tool_run(tmp_path, "-k", "test_a or test_killed").returncode == 0
    stale = {**records(out / "tests")["test_a"], "nodeid": "test_sample.py::test_c", "module": "an earlier version"}
    (out / "tests" / "test_sample.py_test_c.json").write_text(json.dumps(stale))
    written = tool_run(tmp_path, "--summary", "--vllm", release())
    assert written.returncode == 0, written.stdout + written.stderr
    doc = json.loads((out / "summary.json").read_text())
    assert (doc["tests"], doc["recorded"], doc["outcomes"]) == (4, 2, {"passed": 1, "skipped": 1}), doc
    assert doc["modules"] == {"test_sample.py": {"passed": 1, "skipped": 1, "left": 2}}
    assert doc["not_passed"] == {"test_sample.py::test_killed": "Skipped: no"}
    assert doc["left"] == ["test_sample.py::test_c", "test_sample.py::test_d"]  # test_c's record is of another module
    assert doc["multi_gpu"] == ["test_sample.py::test_two_gpus"] and doc["commits"] == [COMMIT[:7]]
    assert (out / "TESTS.md").read_text().count("| `test_sample.py::") == 3


def test_a_test_whose_module_changed_runs_again(tmp_path):
    """Records are kept per test module: a change to the module (not to the code every test shares, which names
    the folder) runs its tests again, and only then."""
    out = tmp_path / "results" / f"{code_id()}_{release()}"
    (tmp_path / "test_sample.py").write_text(SUITE.replace("os.kill(os.getpid(), signal.SIGKILL)", "pass"))
    assert tool_run(tmp_path).returncode == 0
    assert "4 of 4 tests recorded, 0 left" in tool_run(tmp_path).stdout
    assert ran(tmp_path) == ["a", "killed", "c", "d"]  # recorded: not run twice
    assert {r["module"] for r in records(out / "tests").values()} == {module_id(tmp_path / "test_sample.py")}

    with (tmp_path / "test_sample.py").open("a") as f:
        f.write("# changed\n")
    module_id.cache_clear()
    listed = tool_run(tmp_path, "--list")
    assert "0 of 4 tests recorded, 4 left" in listed.stdout, listed.stdout
    assert tool_run(tmp_path).returncode == 0
    assert ran(tmp_path) == ["a", "killed", "c", "d"] * 2
    assert {r["module"] for r in records(out / "tests").values()} == {module_id(tmp_path / "test_sample.py")}


def test_the_budget_starts_no_test_once_spent(tmp_path):
    out = tmp_path / "records"
    run = pytest_run(tmp_path, BUDGET, "--test-records", str(out), "--budget-s", "2")
    assert run.returncode == 2, run.stdout + run.stderr  # interrupted
    assert "the time budget of 2 s is spent" in run.stdout
    assert ran(tmp_path) == ["1"]
    assert set(records(out)) == {"test_1"}
    assert "1 of 3 tests recorded, 2 left: next test_sample.py::test_2" in run.stdout


def test_records_are_named_by_the_code_they_ran_not_by_results_or_docs():
    files = {p.relative_to(ROOT).as_posix() for p in code_files()}
    assert {"qwen4_exp_hcu/__init__.py", "tests/conftest.py", "pyproject.toml", "configs/release_config.json"} <= files
    assert not {f for f in files if f.startswith(("docs/", "benchmarks/results/", "tools/"))}
    assert "benchmarks/figures.py" not in files and "benchmarks/bench_serve.py" in files
    assert len(code_id()) == 12 and code_id() == code_id()
    shared = {p.relative_to(ROOT).as_posix() for p in shared_files()}
    assert {"tests/conftest.py", "tests/gpu_vllm_stand_ins.py", "pyproject.toml"} <= shared  # the stand-ins: every engine's
    assert not {f for f in shared if f.startswith("tests/test_")} and "tests/helpers/records.py" not in files
    # a test module's own: itself and the test modules, helpers, test scripts and benchmarks it reaches
    gpu = {p.relative_to(ROOT).as_posix() for p in reach(ROOT / "tests/test_vllm_gpu.py")}
    assert {"tests/helpers/scenarios.py", "tests/helpers/faults.py", "tests/vllm_gpu_worker.py"} <= gpu
    assert not {"tests/helpers/scenarios.py", "tests/helpers/faults.py", "tests/vllm_gpu_worker.py"} & shared
    assert "tests/helpers/layers.py" not in gpu  # a helper the module never names
    assert module_id(ROOT / "tests/test_vllm_gpu_formats.py") != module_id(ROOT / "tests/test_vllm_gpu.py")
    assert "benchmarks/bench_serve.py" not in shared
