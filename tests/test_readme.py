"""The README's CPU commands run as written: every fenced block right after a `<!-- readme-test -->` line,
from the repository root (bash blocks with `bash -e`, Python blocks as a script file, the way the README
says to run them). The first block writes the tiny checkpoint the later ones use; on the CPU they run, in
README order, while the first one serves it, and the session starts them first, beside the other tests."""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
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


def start_block(i: int, kind: str, code: str, tmp_path: Path, env: dict) -> subprocess.Popen:
    """Block `i` started, its stdout and stderr written to `block{i}.out` / `.err` in `tmp_path`."""
    if kind == "bash":
        cmd = ["bash", "-e", "-c", code]
    else:
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    with open(tmp_path / f"block{i}.out", "w") as out, open(tmp_path / f"block{i}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, start_new_session=True)


def finish_block(i: int, kind: str, code: str, tmp_path: Path, proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = ((tmp_path / f"block{i}.{stream}").read_text() for stream in ("out", "err"))
    assert proc.returncode == 0, f"README block {i} ({kind}) failed:\n{code}\n--- output ---\n{(stdout + stderr)[-4000:]}"
    if kind == "bash":
        assert '"finish_reason":"length"' in stdout, stdout[-2000:]  # the server answered
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_block(i: int, kind: str, code: str, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    return finish_block(i, kind, code, tmp_path, start_block(i, kind, code, tmp_path, env))


def run_cpu_blocks(tmp_path: Path) -> None:
    """The first block writes the checkpoint, then serves it (the slowest step, ~40 s of process starts on
    2 cores): it runs while the later blocks run, started once its first output line is out, which the
    checkpoint line (it prints the path) or the `--help` line after it writes."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    (kind, code), *later = readme_blocks()
    first = start_block(0, kind, code, tmp_path, env)
    try:
        while first.poll() is None and not (tmp_path / "block0.out").stat().st_size:
            time.sleep(0.5)
        if first.poll() is not None:  # it failed (or finished) before the later blocks could start
            finish_block(0, kind, code, tmp_path, first)
        for i, (later_kind, later_code) in enumerate(later, start=1):
            run_block(i, later_kind, later_code, tmp_path, env)
        finish_block(0, kind, code, tmp_path, first)
    finally:
        if first.poll() is None:  # a later block failed: stop the first one and the server it started
            os.killpg(first.pid, signal.SIGTERM)
            first.wait()


def start_in_background(tmp_path: Path) -> Future | None:
    """`run_cpu_blocks` in a thread, for the session to start first (`conftest.py`): its ~70 s are mostly
    process starts and waits, which then run beside the other tests. None where the test skips."""
    if not (ROOT / ".venv/bin/activate").exists():
        return None
    return ThreadPoolExecutor(1, thread_name_prefix="readme").submit(run_cpu_blocks, tmp_path)


BACKGROUND: Future | None = None  # set by conftest.py when this module's CPU test is selected


def test_readme_cpu_blocks_run_as_written(tmp_path):
    if not (ROOT / ".venv/bin/activate").exists():
        pytest.skip("the README's commands use the .venv that `make test` creates")
    if BACKGROUND is None:
        run_cpu_blocks(tmp_path)
    else:
        BACKGROUND.result()


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
