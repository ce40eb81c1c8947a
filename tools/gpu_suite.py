"""The whole GPU suite on the shipped code, over as many device calls as the machine's time limit needs.

Each call runs, in pytest's order, the GPU tests (markers `gpu` or `vllm`, `multi_gpu` only with --multi-gpu, never
`cpu_only`) that have no finished record in benchmarks/results/gpu_suite/<code>_<vLLM release>/tests/ yet, and
starts none once --budget-s has passed, so the call ends inside the limit. Every test leaves one JSON there as it
ends (outcome, seconds, message, figures, commit, code, vLLM release, device, graph mode: `helpers.records`); a test the
limit cuts short anyway runs first in the next call. The run's other result files (`vllm_gpu_modes.json`, the run
record `suite_vllm-*.json`) go into the folder beside `tests/`. Each test module with tests left runs in a pytest
process of its own: a CUDA fault (an illegal address poisons the process's context) stays in the module that caused
it. Arguments after `--` go to pytest (without a test path, `tests`). <code> is `run_record.code_id()`, a hash of
what every test runs (the package, the configs, conftest, the GPU machine's stand-ins), and each record names its
test module's own (`run_record.module_id()`: the module and the test modules, helpers, workers and benchmarks it
names): a later commit that changes neither (results, docs, another test module, a helper it does not use) finds the
records; a test whose module or helper changed runs again.

    QWEN4_EXP_HCU_COMMIT=<commit> python3 tools/gpu_suite.py --budget-s 420    # on the GPU machine, again and again
    python3 tools/gpu_suite.py --list --vllm 0.33.0          # this tree's: what is left (collects, runs nothing)
    python3 tools/gpu_suite.py --table --vllm 0.33.0         # the records as a markdown table
    python3 tools/gpu_suite.py --summary --vllm 0.33.0       # summary.json + TESTS.md in the records' folder
"""

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.records import current, finished, read_records  # noqa: E402
from helpers.run_record import code_id, commit, release  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu_suite"
MARKERS = "(gpu or vllm) and not cpu_only"
MULTI_MARKERS = "(gpu or vllm or multi_gpu) and not cpu_only"  # a multi-GPU test needs neither of the others
COLUMNS = ("test", "outcome", "graph mode", "figures", "device", "commit", "vLLM")
PATHLESS = ("-k", "-m", "-p", "--rootdir", "--deselect")  # pytest options whose value is not a test path


def folder(results: Path, code: str, release: str) -> Path:
    return results / f"{code}_{release}"


def pytest_command(folder: Path, budget_s: float, multi_gpu: bool, list_only: bool, extra: list[str],
                   resume: bool = True) -> list[str]:
    markers = MULTI_MARKERS if multi_gpu else f"({MARKERS}) and not multi_gpu"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", markers,
           "--test-records", str(folder / "tests"), *(["--resume"] if resume else [])]  # fmt: skip
    if list_only:
        return cmd + ["--collect-only", "-q", *extra]
    return cmd + ["-q", "-rfE", "--budget-s", f"{budget_s:g}", "--results-dir", str(folder), *extra]


def node_ids(listing: str) -> list[str]:
    """The tests of a `--collect-only -q` listing, in its order."""
    return [line for line in listing.splitlines() if "::" in line and " " not in line.partition("::")[0]]


def modules_left(listing: str) -> list[str]:
    """The test modules of a `--collect-only -q` listing, in its order."""
    return list(dict.fromkeys(p for n in node_ids(listing) if (p := n.partition("::")[0]).endswith(".py")))


def named_paths(args: list[str]) -> list[str]:
    return [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in PATHLESS)]


def node_root(extra: list[str]) -> Path:
    """Where the node ids' paths start: pytest's --rootdir among `extra`, else the checkout."""
    return Path(extra[extra.index("--rootdir") + 1]) if "--rootdir" in extra else ROOT


def cell(value) -> str:
    return " ".join(str(value).split()).replace("|", "\\|")


def outcome(record: dict, root: Path) -> str:
    module = root / record["nodeid"].partition("::")[0]
    changed = module.is_file() and not current(record, module)
    changed = " (made with an earlier version of its test module)" if changed else ""
    return record["outcome"] + (f": {record['reason']}" if record.get("reason") else "") + changed


def table(folder: Path, root: Path = ROOT) -> str:
    """The markdown table of a folder's records, one row per test, by node id (`root`: where their node ids'
    paths start; a record of a test module that has changed since says so)."""
    rows = [COLUMNS, ["---"] * len(COLUMNS)]
    for nodeid, r in sorted(read_records(folder / "tests").items()):
        figures = "; ".join(f"{name} {value}" for name, value in r["figures"].items())
        rows.append([f"`{nodeid.removeprefix('tests/')}`", outcome(r, root), r["graph_mode"] or "—", figures or "—",
                     r["device"], r["commit"][:7], r["vllm"]])  # fmt: skip
    return "\n".join("| " + " | ".join(cell(v) for v in row) + " |" for row in rows) + "\n"


def summary(folder: Path, suite: list[str], multi_gpu: list[str], root: Path = ROOT) -> dict:
    """What the records of `folder` say of the `suite` this tree collects (node ids): the tests with a finished
    record made with their module as it is now, their outcomes overall and per module, the reasons of those that did
    not pass, and the tests left; `multi_gpu`: the suite's multi-GPU tests, which need a machine of several GPUs."""
    records = read_records(folder / "tests")
    done = {nodeid: records[nodeid] for nodeid in suite
            if nodeid in records and finished(records[nodeid]) and current(records[nodeid], root / nodeid.partition("::")[0])}  # fmt: skip
    modules: dict[str, Counter] = {}
    for nodeid in suite:
        modules.setdefault(nodeid.partition("::")[0], Counter())[done[nodeid]["outcome"] if nodeid in done else "left"] += 1
    code, _, release_ = folder.name.partition("_")
    return {
        "code": code, "vllm": release_, "tests": len(suite), "recorded": len(done),
        "outcomes": dict(Counter(r["outcome"] for r in done.values()).most_common()),
        "modules": {module: dict(counts) for module, counts in modules.items()},
        "not_passed": {nodeid: r.get("reason") or r["outcome"] for nodeid, r in done.items() if r["outcome"] != "passed"},
        "left": [nodeid for nodeid in suite if nodeid not in done],
        "multi_gpu": multi_gpu,
        "machines": dict(sorted(Counter(r["device"] for r in done.values()).items())),  # one GPU each: tests run where lent
        "commits": sorted({r["commit"][:7] for r in done.values()}),
        "test_seconds": round(sum(r["seconds"] for r in done.values())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # pytest has --co, --lf
    ap.add_argument("--budget-s", type=float, default=420, help="start no test after this many seconds (default 420)")
    ap.add_argument("--multi-gpu", action="store_true", help="the multi_gpu tests too")
    ap.add_argument("--list", action="store_true", help="say what is recorded and list what is left; run nothing")
    ap.add_argument("--table", action="store_true", help="print the records as a markdown table; run nothing")
    ap.add_argument("--summary", action="store_true", help="write summary.json (what is recorded, what is left) and "
                    "TESTS.md (the table) into the records' folder; run nothing")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--commit", default=None, help="the commit the records name (default: QWEN4_EXP_HCU_COMMIT, "
                    "else git's HEAD)")
    ap.add_argument("--code", default=None, help="with --list or --table: the code whose records to read (default: "
                    "this tree's)")
    ap.add_argument("--vllm", default=None, help="with --list or --table: the release whose records to read "
                    "(default: the installed one)")
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    reads = args.list or args.table or args.summary
    if args.vllm and not reads:
        ap.error("--vllm names the records to read: a run records the installed release")
    sha = args.commit or commit()
    if sha == "unknown":
        ap.error("no commit: this tree has no git; set QWEN4_EXP_HCU_COMMIT to the caller's `git rev-parse HEAD`")
    if args.code and not reads:
        ap.error("--code names the records to read: a run records this tree's code")
    out = folder(args.results, args.code or code_id(), args.vllm or release())
    if not named_paths(extra):
        extra.append("tests")  # pytest reads the records' options from tests/conftest.py only when given a path there
    if args.table:
        print(table(out), end="")
        return 0
    env = {**os.environ, "QWEN4_EXP_HCU_COMMIT": sha}
    if args.summary:
        return write_summary(out, extra, env)
    listing = pytest_command(out, args.budget_s, args.multi_gpu, True, extra)
    print(f"{out}: {' '.join(listing[1:])}", flush=True)
    if args.list:
        subprocess.run(listing, cwd=ROOT, env=env)
        return 0
    left = subprocess.run(listing, cwd=ROOT, env=env, capture_output=True, text=True)
    if left.returncode not in (0, 5):  # the collection failed (5: nothing left to collect)
        print(left.stdout + left.stderr, flush=True)
        return left.returncode
    print("\n".join(line for line in left.stdout.splitlines() if "tests recorded" in line), flush=True)
    options = [a for a in extra if a not in named_paths(extra)]
    rootdir = node_root(options)
    start, status = time.monotonic(), 0
    for module in modules_left(left.stdout):
        budget = args.budget_s - (time.monotonic() - start)
        if budget <= 0:
            print(f"budget spent: {module} and after wait for the next call", flush=True)
            break
        cmd = pytest_command(out, budget, args.multi_gpu, False, [*options, str(rootdir / module)])
        print(f"{out}: {' '.join(cmd[1:])}", flush=True)
        code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        code = code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
        status = status if code in (0, 5) else code  # 5: nothing collected (every test of the module recorded)
    return status


def write_summary(out: Path, extra: list[str], env: dict) -> int:
    """summary.json and TESTS.md for the records of `out`, against the GPU tests this tree collects."""
    suites = []
    for multi_gpu in (False, True):
        cmd = pytest_command(out, 0, multi_gpu, True, extra, resume=False)
        listing = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if listing.returncode != 0:
            print(listing.stdout + listing.stderr, flush=True)
            return listing.returncode
        suites.append(node_ids(listing.stdout))
    rootdir = node_root(extra)
    doc = summary(out, suites[0], [n for n in suites[1] if n not in set(suites[0])], rootdir)
    doc["command"] = f"python3 tools/gpu_suite.py --summary --vllm {doc['vllm']}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "TESTS.md").write_text(f"# GPU suite records: code {doc['code']}, vLLM {doc['vllm']}\n\n"
                                  f"Written by `{doc['command']}`.\n\n" + table(out, rootdir))
    print(f"{out}: {doc['recorded']} of {doc['tests']} tests recorded ({doc['outcomes']}), {len(doc['left'])} left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
