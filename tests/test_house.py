"""The package's shape, as docs/ARCHITECTURE.md draws it: layers import downward only, no import circle, modules and
functions small enough to read, no history in comments. Read from the source text; nothing is imported."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qwen4_exp_hcu"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # outside kernels/: a Triton kernel is one launch, read top to bottom
# The layers, lowest first: a module may import its own layer and the ones below it.
LAYERS = [
    {"env", "names", "settings"},
    {"kernels"},
    {"norm"},
    {"ple"},
    {"quantize", "checkpoint_folder", "tiny", "model", "vllm_plugin", "startup_report", "demo"},
]
# A date, a month, a numbered run / session / round, a commit the code was at, or what the code was before, told
# as history.
HISTORY = re.compile(
    r"\b20\d\d-\d\d\b|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* 20\d\d\b"
    r"|\b(session|run|round) \d+\b|\bsessions \d+\b|\b(code at|commit) [0-9a-f]{7,40}\b"
    r"|\b(previously|formerly|originally)\b|\b(earlier|previous|old|former) (implementation|version|default|code)s?\b",
    re.IGNORECASE,
)


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(root.rglob("*.py"))}


def _imports(module: str, path: Path) -> set[str]:
    """The package modules `module` imports (relative imports resolved), at any depth of the file."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("qwen4_exp_hcu.")}


def _layer(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` is, or None for a name imported from a module (`from pkg.mod import thing`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_has_a_layer():
    for module in _modules():
        if module != "qwen4_exp_hcu":
            _layer(module)  # StopIteration names an unplaced module


def test_imports_point_down():
    modules = _modules()
    upward = []
    for module, path in modules.items():
        if module == "qwen4_exp_hcu":
            continue
        for target in {_known(n, modules) for n in _imports(module, path)} - {None, "qwen4_exp_hcu"}:
            if _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_kernels_import_only_kernels_and_env():
    modules = _modules()
    for module, path in _modules(PACKAGE / "kernels").items():
        targets = {_known(n, modules) for n in _imports(module, path)} - {None}
        assert all(t.startswith("qwen4_exp_hcu.kernels") or t == "qwen4_exp_hcu.env" for t in targets), (module, targets)


def test_no_import_circle():
    modules = _modules()
    graph = {m: {_known(n, modules) for n in _imports(m, p)} - {None, m} for m, p in modules.items()}
    # A package's __init__ that its own modules import is not a circle of code, only of names.
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            if m.startswith(t + "."):
                continue
            if state.get(t) == 1:
                pytest.fail("import circle: " + " -> ".join(trail[trail.index(t):] + [m, t]) if t in trail else t)
            if t not in state:
                visit(t, trail + [m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small_enough_to_read(path):
    assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("folder", ["qwen4_exp_hcu", "benchmarks"])
def test_functions_are_short_outside_kernels(folder):
    long = [f"{p.relative_to(ROOT)}:{name} ({n} lines)" for p in sorted((ROOT / folder).rglob("*.py"))
            if "kernels" not in p.parts for name, n in _functions(p)
            if n > MAX_FUNCTION_LINES]
    assert not long, long


def _comments(path: Path):
    text = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            yield tok.start[0], tok.string


@pytest.mark.parametrize("folder", ["qwen4_exp_hcu", "benchmarks"])
def test_comments_tell_no_history(folder):
    paths = [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".c") and "results" not in p.parts]
    told = []
    for p in paths:
        if p.suffix == ".c":
            lines = [(i + 1, line) for i, line in enumerate(p.read_text().splitlines()) if "//" in line or "*" in line]
        else:
            lines = list(_comments(p))
        told += [f"{p.relative_to(ROOT)}:{i}: {HISTORY.search(s)[0]}" for i, s in lines if HISTORY.search(s)]
    assert not told, told


def test_the_history_pattern_catches_history():
    for told in ("# 2026-11 wrote the rows twice", "# session 12 measured 0.9x", "# run 3 on the H200",
                 "# as of Nov 2026", "# sessions 16 -> 18", "# code at 34c0771", "# previously 8 warps",
                 "# what the earlier implementation fed F.embedding", "# the old default's 10 splits"):
        assert HISTORY.search(told), told
    for fine in ("# 2 MiB pages", "# one round of 256 lookups", "# rows 0-2047", "# waits for the previous kernel",
                 "# the default launch", "# in-flight kernels use the old buffers", "# the decode step runs 97 times"):
        assert not HISTORY.search(fine), fine
