"""`--test-records DIR` (a pytest plugin, loaded by `conftest.py`): one JSON per test in DIR, written as the test
starts (outcome "unfinished") and again as it ends, so a run killed by a time limit keeps every finished test's
file and names the test it cut short. A record holds the node id, the outcome, the seconds, the message where the
test did not pass and its one-line `reason`, the commit, the vLLM release, the device, the graph mode where the
test has one (its `mode` or `graph_mode` parameter, or what it records as `graph_mode`) and the figures it attaches
with pytest's `record_property`.

`--resume` deselects the tests DIR holds a finished record of, made with their test module as it is now
(`run_record.module_id`: DIR is named after the code every test shares, `code_id`). A test cut short counts as
finished only when it was the first of its run: it had a whole run's time and did not finish in it, so running it
again would not help.
`--budget-s S` starts no test once S seconds have passed since the run began; the tests it leaves get no file.
`tools/gpu_suite.py` runs the GPU suite over as many runs as it takes with these options."""

import json
import os
import re
import time
from functools import cache
from pathlib import Path

import pytest

from helpers.run_record import add_report, code_id, commit, module_id, release

UNFINISHED = "unfinished"
GRAPH_MODE_PARAMS = ("graph_mode", "mode")


def pytest_addoption(parser):
    group = parser.getgroup("test records")
    group.addoption("--test-records", default=None, metavar="DIR", help="write one JSON per test into DIR")
    group.addoption("--resume", action="store_true", help="with --test-records: run only the tests without a record")
    group.addoption("--budget-s", type=float, default=None, metavar="S",
                    help="start no test once S seconds have passed since the run began")  # fmt: skip


def pytest_configure(config):
    directory, budget = config.getoption("--test-records"), config.getoption("--budget-s")
    if directory is not None or budget is not None:
        plugin = TestRecords(None if directory is None else Path(directory), budget, config.getoption("--resume"))
        config.pluginmanager.register(plugin, "test_records")


def record_path(directory: Path, nodeid: str) -> Path:
    return directory / (re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid.removeprefix("tests/"))[:200] + ".json")


def read_records(directory: Path) -> dict[str, dict]:
    """Node id -> record, for every record in `directory`."""
    docs = (json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))) if directory.is_dir() else ()
    return {doc["nodeid"]: doc for doc in docs}


def finished(record: dict) -> bool:
    return record["outcome"] != UNFINISHED or record["ran_first"]


def current(record: dict, path: Path) -> bool:
    """Whether `record` was made with the test module at `path` as it is now."""
    return record.get("module") == module_id(path)


@cache
def machine() -> dict:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"commit": commit(), "code": code_id(), "vllm": release(), "device": device}


def graph_mode(item) -> str | None:
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    return next((params[name] for name in GRAPH_MODE_PARAMS if isinstance(params.get(name), str)), None)


class TestRecords:
    """A pytest plugin: writes each test's record as it starts and ends; deselects and stops as its options say."""

    __test__ = False  # a plugin, not a test class

    def __init__(self, directory: Path | None, budget_s: float | None, resume: bool):
        self.directory, self.budget_s, self.resume = directory, budget_s, resume
        self.began, self.records, self.suite = time.monotonic(), {}, {}

    @pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected theirs
    def pytest_collection_modifyitems(self, config, items):
        self.suite = {item.nodeid: item.path for item in items}
        if not (self.resume and self.directory):
            return
        done = self.done(read_records(self.directory))
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = [item for item in items if item.nodeid not in done]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item):
        if self.budget_s is not None and time.monotonic() - self.began > self.budget_s:
            item.session.shouldstop = f"the time budget of {self.budget_s:g} s is spent"
            return True  # the test does not run and reports nothing
        self.records[item.nodeid] = {
            "nodeid": item.nodeid, "outcome": UNFINISHED, "seconds": 0.0, **machine(), "module": module_id(item.path),
            "graph_mode": graph_mode(item),
            "figures": {}, "ran_first": not self.records, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }  # fmt: skip
        self.write(self.records[item.nodeid])
        return None

    def pytest_runtest_logreport(self, report):
        record = self.records[report.nodeid]
        if record["outcome"] == UNFINISHED:
            record["outcome"] = "passed"
        add_report(record, report)
        if "message" in record and "reason" not in record:  # pytest's one-line summary, as `-rf` prints it
            crash = getattr(report.longrepr, "reprcrash", None)
            record["reason"] = (crash.message if crash else record["message"]).strip().partition("\n")[0][:200]
        if report.when == "teardown":  # the last phase: every test that ran has one
            figures = dict(report.user_properties)
            record["graph_mode"] = figures.pop("graph_mode", record["graph_mode"])
            record["figures"] = figures
            self.write(record)

    def done(self, records: dict[str, dict]) -> set[str]:
        """The suite's tests with a finished record made with their test module as it is now."""
        return {nodeid for nodeid, path in self.suite.items()
                if nodeid in records and finished(records[nodeid]) and current(records[nodeid], path)}  # fmt: skip

    def write(self, record: dict) -> None:
        """Whole files only: a run killed while writing leaves the last complete record."""
        if self.directory is None:
            return
        path = record_path(self.directory, record["nodeid"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(record, indent=1, default=str) + "\n")
        os.replace(path.with_suffix(".tmp"), path)

    def pytest_terminal_summary(self, terminalreporter):
        if self.directory is None:
            return
        done = self.done(read_records(self.directory))
        left = [nodeid for nodeid in self.suite if nodeid not in done]
        terminalreporter.section("test records")
        terminalreporter.write_line(f"{self.directory}: {len(self.suite) - len(left)} of {len(self.suite)} tests "
                                    f"recorded, {len(left)} left{': next ' + left[0] if left else ''}")  # fmt: skip
