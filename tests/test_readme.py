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


def run_block(i: int, kind: str, code: str, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
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
    return proc


def test_readme_cpu_blocks_run_as_written(tmp_path):
    if not (ROOT / ".venv/bin/activate").exists():
        pytest.skip("the README's commands use the .venv that `make test` creates")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for i, (kind, code) in enumerate(readme_blocks()):
        run_block(i, kind, code, tmp_path, env)


@pytest.mark.gpu
def test_readme_blocks_run_on_gpu(tmp_path):
    """The same blocks on a GPU machine with vLLM 0.33 (a `pip install -e '.[gpu]'`, or `source
    .gpu-vllm/setup.sh` of `../shared/gpu-vllm`): that environment, with `python` on the PATH, stands for the
    `.venv` line, and the engines get the settings every vLLM 0.33 GPU install runs (`helpers.scenarios.GPU_ENGINE`:
    the shared tool's Python-only vLLM has no compiled FlashAttention, FlashInfer or custom ops)."""
    import json
    import shlex

    import torch

    from helpers.scenarios import GPU_ENGINE

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"  # a wrapper, not a link: a venv's interpreter finds its venv by its path
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    flags = " ".join(f"--{key.replace('_', '-')} {shlex.quote(json.dumps(value))}" for key, value in GPU_ENGINE.items())
    for i, (kind, code) in enumerate(readme_blocks()):
        code = code.replace("source .venv/bin/activate\n", "")
        code = code.replace("--max-model-len 256", f"--max-model-len 256 {flags}")
        code = code.replace("max_model_len=256)", f"max_model_len=256, **{GPU_ENGINE!r})")
        proc = run_block(i, kind, code, tmp_path, env)
        print(f"--- README block {i} ({kind}):\n{(proc.stdout + proc.stderr)[-1500:]}")
