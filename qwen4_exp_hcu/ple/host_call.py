"""Host work in a GPU stream's order: `cuLaunchHostFunc` (CUDA) / `hipLaunchHostFunc` (ROCm, HCU).

The driver runs the function on its own thread once the stream's earlier work is done, and holds back the
stream's later work until it returns. A CUDA graph captures the launch as a host node, so host work (the file
tier's reads from the checkpoint's files) runs inside full decode graphs, and never blocks the Python thread
that queues the step. The function must not call the GPU runtime (no CUDA/HIP calls, no CUDA tensors): it
works on host memory, with the GIL, which the thread queuing the step gives up while it waits on the GPU.
Two costs of running Python there, not yet measured: the stream waits for the GIL while another thread runs
Python (up to the interpreter's switch interval, 5 ms), and a garbage collection that starts in the function
runs finalizers on the driver's thread, where a CUDA object's (an event's destroy) would break that rule. The
way out of both, not built: host nodes that are C functions (a semaphore post, then a wait) in front of a Python
worker thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
import traceback
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_LAUNCH = None
RUNTIMES = {"cuda": (("libcuda.so.1",), "cuLaunchHostFunc"),
            "hip": (("libamdhip64.so", "libamdhip64.so.6", "libgalaxyhip.so"), "hipLaunchHostFunc")}  # fmt: skip


def launcher():
    """The runtime's launch function, loaded once (the driver library torch already loaded); a platform without it
    fails here, naming the symbol: the file tier calls this at load."""
    global _LAUNCH
    if _LAUNCH is None:
        libraries, symbol = RUNTIMES["hip" if torch.version.hip else "cuda"]
        errors = []
        for name in libraries:
            try:
                launch = getattr(ctypes.CDLL(name), symbol)
                break
            except (OSError, AttributeError) as e:
                errors.append(f"{name}: {e}")
        else:
            raise RuntimeError(f"PLE rows from files need {symbol} to run host reads in stream order: {'; '.join(errors)}")
        launch.argtypes, launch.restype = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p], ctypes.c_int
        _LAUNCH = launch
    return _LAUNCH


_TRAMPOLINES = []  # never freed: a captured graph or a queued launch may call one after its owner has gone


@dataclass
class HostCallStats:
    """The function's own time on the driver's thread (from when it holds the GIL): set against the GPU's wait for
    it, what is left is the wait for the GIL."""

    calls: int = 0
    seconds: float = 0.0
    longest: float = 0.0

    def describe(self) -> str:
        if not self.calls:
            return "host function never ran"
        return f"host function {self.calls} calls, {self.seconds / self.calls * 1e3:.3f} ms mean, {self.longest * 1e3:.2f} ms longest"


class HostCall:
    """`fn(arg: int)` launched in a stream's order (`launch(stream, arg)`), captured by CUDA graphs. A bound
    method is held weakly: its owner (the file tier's rows) holds this object, and a reference cycle would leave
    it to a garbage collection, which may run on the driver's thread, freeing pinned memory there."""

    def __init__(self, fn: Callable[[int], None], what: str) -> None:
        self.what = what
        self.stats = stats = HostCallStats()
        target = weakref.WeakMethod(fn) if isinstance(fn, types.MethodType) else (lambda: fn)

        def run(arg) -> None:
            f = target()
            if f is None:  # its owner is gone, and with it every lookup that would read what it stages
                return
            try:
                t0 = time.perf_counter()
                f(arg or 0)
                took = time.perf_counter() - t0
                stats.calls, stats.seconds, stats.longest = stats.calls + 1, stats.seconds + took, max(stats.longest, took)
            except BaseException:  # nothing can be raised into the stream: the kernels after it would read stale rows
                logger.critical("%s failed on the driver's host thread; stopping the process:\n%s", what, traceback.format_exc())
                sys.stderr.flush()
                os.abort()

        self._trampoline = _HOST_FN(run)
        _TRAMPOLINES.append(self._trampoline)

    def launch(self, stream: torch.cuda.Stream, arg: int) -> None:
        status = launcher()(ctypes.c_void_p(stream.cuda_stream), self._trampoline, ctypes.c_void_p(arg))
        if status != 0:
            raise RuntimeError(f"{self.what}: launching the host function failed with driver status {status}.")
