"""The README's CPU commands run as written: every fenced block right after a `<!-- readme-test -->` line,
in README order, from the repository root (bash blocks with `bash -e`, Python blocks as a script file, the
way the README says to run them). The first block writes the tiny checkpoint the later ones use."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- readme-test -->\n```(bash|python)\n(.*?)```", re.S)
TIMEOUT_S = 600

pytestmark = pytest.mark.vllm


def readme_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_readme_marks_the_cpu_blocks():
    kinds = [kind for kind, _ in readme_blocks()]
    assert kinds.count("bash") >= 1 and kinds.count("python") >= 2, kinds


def test_readme_cpu_blocks_run_as_written(tmp_path):
    if not (ROOT / ".venv/bin/activate").exists():
        pytest.skip("the README's commands use the .venv that `make test` creates")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for i, (kind, code) in enumerate(readme_blocks()):
        if kind == "bash":
            cmd = ["bash", "-e", "-c", code]
        else:
            script = tmp_path / f"block{i}.py"
            script.write_text(code)
            cmd = [sys.executable, str(script)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"README block {i} ({kind}) failed:\n{code}\n--- output ---\n{(proc.stdout + proc.stderr)[-4000:]}"
        if kind == "bash":
            assert '"finish_reason":"length"' in proc.stdout, proc.stdout[-2000:]  # the server answered
