"""The `--results-dir DIR` option (a pytest plugin, loaded by `conftest.py`). With it, each pytest run writes one
JSON: every test's outcome and duration, the command, the commit, the vLLM release and the machine
(`DIR/suite_vllm-<release>_<time>.json`). Per-test figures stay in the files
the tests write themselves (e.g. `vllm_gpu_modes.json`); `--test-records` (`helpers.records`) writes one file per
test instead.

The GPU machine receives a copy of the working tree without git: there the commit comes from
`QWEN4_EXP_HCU_COMMIT` (the caller's `git rev-parse HEAD`). `code_id()` names the code a record holds for, so that
a commit that only adds results or docs keeps the records of the one before it."""

import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    if os.environ.get("QWEN4_EXP_HCU_COMMIT"):
        return os.environ["QWEN4_EXP_HCU_COMMIT"]
    run = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


# What the tests run: the package, the tests and the configs and benchmarks they load; not the docs, the results, the
# figures made from them, the tools that drive the device, nor the record keeping (it writes down what the tests did
# and changes none of it).
CODE_PARTS = ("qwen4_exp_hcu", "tests", "configs", "benchmarks", "pyproject.toml")
CODE_SUFFIXES = (".py", ".c", ".h", ".toml", ".yaml", ".json")
NOT_CODE = ("benchmarks/results/", "benchmarks/figures.py", "tests/helpers/records.py", "tests/helpers/run_record.py")
TEST_MODULE = re.compile(r"tests/(test_\w+)\.py")
# A file's reach: the test modules, helpers, test scripts and benchmarks it names (imports, `-m benchmarks.x`, paths).
NAMED_TEST_MODULE = re.compile(r"^\s*(?:from|import)\s+(test_\w+)", re.M)
NAMED_BENCHMARK = re.compile(r"benchmarks[./](\w+)|from benchmarks import \(?([\w ,\n]+)")
NAMED_HELPER = re.compile(r"\bhelpers[./](\w+)|from helpers import \(?([\w ,\n]+)")
# Loaded by the GPU machine's environment into every vLLM process (../shared/gpu-vllm's setup.sh), named by none.
ENVIRONMENT = ("tests/gpu_vllm_stand_ins.py",)


@cache
def code_files() -> tuple[Path, ...]:
    found = []
    for part in CODE_PARTS:
        top = ROOT / part
        for path in [top] if top.is_file() else top.rglob("*"):
            name = path.relative_to(ROOT).as_posix()
            hidden = any(p.startswith(".") or p == "__pycache__" for p in path.relative_to(ROOT).parts)
            if path.is_file() and path.suffix in CODE_SUFFIXES and not hidden and not name.startswith(NOT_CODE):
                found.append(path)
    return tuple(sorted(found))


@cache
def _scripts() -> dict[str, Path]:
    """The test scripts a test names by their file's stem (workers, the release runner, their stand-ins)."""
    return {p.stem: p for p in (ROOT / "tests").glob("*.py")
            if not p.name.startswith("test_") and p.name != "conftest.py" and p.relative_to(ROOT).as_posix() not in ENVIRONMENT}  # fmt: skip


def _names(found) -> list[str]:
    return [name.strip() for one, many in found for name in [one, *many.replace("(", "").split(",")] if name.strip()]


@cache
def reach(path: Path, test_modules: bool = True) -> set[Path]:
    """`path` and the code it names (test modules only with `test_modules`), and theirs, and so on."""
    scripts, code = _scripts(), set(code_files())
    named_script = re.compile(r"\b(" + "|".join(map(re.escape, scripts)) + r")\b") if scripts else None
    found, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in found or not current.is_file() or (current != path and current not in code):
            continue
        found.add(current)
        text = current.read_text()
        todo += [ROOT / "tests" / f"{name}.py" for name in NAMED_TEST_MODULE.findall(text) if test_modules]
        todo += [ROOT / "benchmarks" / f"{name}.py" for name in _names(NAMED_BENCHMARK.findall(text))]
        todo += [ROOT / "tests" / "helpers" / f"{name}.py" for name in _names(NAMED_HELPER.findall(text))]
        todo += [scripts[name] for name in named_script.findall(text)] if named_script else []
    return found


def _is_test_module(path: Path) -> bool:
    return TEST_MODULE.fullmatch(path.relative_to(ROOT).as_posix()) is not None


def _is_benchmark(path: Path) -> bool:
    """A benchmark module (not the package's `__init__`, which every one imports)."""
    return path.parent == ROOT / "benchmarks" and path.suffix == ".py" and path.name != "__init__.py"


@cache
def shared_files() -> tuple[Path, ...]:
    """What every test runs: the package, the configs, conftest and what it names, the GPU machine's stand-ins, and
    any file under tests/ that no test module names. The test modules, and the helpers, test scripts and benchmarks
    they name, count for the tests that reach them (`module_id`): a fix to one helper reruns the tests that use it."""
    files = set(code_files())
    modules = [p for p in files if _is_test_module(p)]
    named = set().union(*(reach(p) for p in modules)) - {ROOT / e for e in ENVIRONMENT}
    by_module = {p for p in files if _is_test_module(p) or _is_benchmark(p)} | (named & files)
    conftest = set().union(*(reach(p, test_modules=False) for p in files if p.name == "conftest.py")) & files
    return tuple(sorted((files - by_module) | conftest))


def _digest(paths) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def code_id() -> str:
    """A hash of what every test runs (`shared_files`, their paths and bytes): the same here and in the device's
    copy of the tree, which has no git. It names the folder of a run's records."""
    return _digest(shared_files())


@cache
def module_id(module: Path) -> str:
    """A hash of what a test module adds to `code_id`: itself and the test modules, helpers, test scripts and
    benchmarks it reaches. A record holds for a tree whose `code_id` names its folder and whose `module_id` of its
    module is the record's."""
    module = module.resolve()
    reached = {p for p in reach(module) if p == module or p in set(code_files())}
    return _digest(reached - set(shared_files()))


def release() -> str:
    """The installed vLLM's version, or "none"."""
    try:
        import vllm
    except ImportError:
        return "none"
    return vllm.__version__


def add_report(entry: dict, report) -> None:
    """Adds one phase's report (setup, call, teardown) to a test's `entry`: its seconds, and the outcome and
    message of the first phase that did not pass."""
    entry["seconds"] = round(entry.get("seconds", 0.0) + report.duration, 2)
    entry.setdefault("outcome", "passed")
    if report.outcome != "passed" and entry["outcome"] == "passed":
        entry["outcome"] = "error" if report.failed and report.when != "call" else report.outcome
        reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else report.longreprtext
        entry["message"] = reason[-1500:]


def pytest_addoption(parser):
    parser.addoption(
        "--results-dir", default=None, metavar="DIR",
        help="write the GPU tests' result JSON (etp_2gpu.json, etp_4gpu.json, vllm_gpu_modes.json) into DIR, "
        "e.g. benchmarks/results, and one record of the run; without it nothing is written",
    )


def pytest_configure(config):
    if config.getoption("--results-dir") is not None:
        config.pluginmanager.register(RunRecord(Path(config.getoption("--results-dir"))), "run_record")


class RunRecord:
    """A pytest plugin: collects the reports, writes the file when the session ends."""

    def __init__(self, results_dir: Path):
        self.results_dir, self.started, self.tests = results_dir, time.time(), {}

    def pytest_runtest_logreport(self, report):
        add_report(self.tests.setdefault(report.nodeid, {"outcome": "passed"}), report)

    def pytest_sessionfinish(self, session, exitstatus):
        if not self.tests:
            return
        import torch

        machine = {"host": platform.node(), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}  # fmt: skip
        counts = dict(Counter(t["outcome"] for t in self.tests.values()))
        vllm = release()
        doc = {"command": "python3 -m pytest " + shlex.join(sys.argv[1:]), "commit": commit(), "vllm": vllm,
               "machine": machine, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
               "seconds": round(time.time() - self.started, 1), "exit_status": int(exitstatus), "counts": counts,
               "tests": self.tests}  # fmt: skip
        out = self.results_dir / f"suite_vllm-{vllm}_{time.strftime('%Y%m%dT%H%M%S', time.gmtime(self.started))}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
