"""A regular (non-editable) install is a working package: what it needs at run time ships inside it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_regular_install_writes_a_tiny_checkpoint(tmp_path):
    src, site = tmp_path / "src", tmp_path / "site"  # pip builds in the source tree: build a copy
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "checkpoints", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(src)],
        check=True,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = lambda *args: subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)  # noqa: E731
    where = run("-c", "import qwen4_exp_hcu.tiny as t; print(t.__file__)").stdout.strip()
    assert Path(where).is_relative_to(site), where  # the installed copy, not the source tree
    run("-m", "qwen4_exp_hcu.tiny", str(tmp_path / "tiny"))
    assert (tmp_path / "tiny" / "config.json").exists() and list((tmp_path / "tiny").glob("*.safetensors"))
