"""Host work in a GPU stream's order: `cuLaunchHostFunc` (CUDA) / `hipLaunchHostFunc` (ROCm, HCU).

The driver runs the function on its own thread once the stream's earlier work is done, and holds back the
stream's later work until it returns. A CUDA graph captures the launch as a host node, so host work (the file
tier's reads from the checkpoint's files) runs inside full decode graphs, and never blocks the Python thread
that queues the step. The function must not call the GPU runtime (no CUDA/HIP calls, no CUDA tensors). It is C
(`ple/tiers/stage.c`): Python there waits for the GIL while the engine's thread runs Python, so a host node's
sub-millisecond work would wait for milliseconds while serving. Python runs there only when the C
function calls back (`guarded`), rarely: a garbage collection it starts runs finalizers on the driver's thread, where
a CUDA object's (an event's destroy) would break that rule.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import traceback
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CALLBACK = ctypes.CFUNCTYPE(None)  # Python a C host function calls back
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
        launch.argtypes, launch.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        _LAUNCH = launch
    return _LAUNCH


def launch(stream: torch.cuda.Stream, function: int, arg: int, what: str) -> None:
    """Queue the C function at address `function` with `arg` (an address) in `stream`."""
    status = launcher()(ctypes.c_void_p(stream.cuda_stream), ctypes.c_void_p(function), ctypes.c_void_p(arg))
    if status != 0:
        raise RuntimeError(f"{what}: launching the host function failed with driver status {status}.")


CALLBACK_SWITCH_INTERVAL_S = 1e-5
"""The interpreter's switch interval while a callback runs. Every numpy call that gives up the GIL lets the engine's
thread take it, and the callback waits up to the interval (5 ms by default) to get it back: beside a busy Python
thread a file-tier promotion takes 15x as long as alone, 3x with this interval (`benchmarks/bench_host_callback.py`,
2-core CPU)."""


def guarded(fn: Callable[[], None], what: str) -> CALLBACK:
    """`fn` as a C callback for a host function; whoever hands it to C keeps it (the file tier's host function state
    holds it, and lives as long as the host nodes that may call it). A bound method is held weakly: its owner (the
    file tier's rows) holds the callback, and a reference cycle would leave it to a garbage collection, which may run
    on the driver's thread, freeing pinned memory there. A failure stops the process, naming `what`: nothing can be
    raised into the stream, and the kernels after it would read stale rows."""
    target = weakref.WeakMethod(fn) if isinstance(fn, types.MethodType) else (lambda: fn)

    def run() -> None:
        f = target()
        if f is None:  # its owner is gone, and with it every lookup that would read what it stages
            return
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, CALLBACK_SWITCH_INTERVAL_S))
        try:
            f()
        except BaseException:
            logger.critical("%s failed on the driver's host thread; stopping the process:\n%s", what, traceback.format_exc())
            sys.stderr.flush()
            os.abort()
        finally:
            sys.setswitchinterval(interval)

    return CALLBACK(run)


@dataclass
class HostCallStats:
    """A host function's own time (kept by the C function itself): set against the GPU's idle time in a profile."""

    calls: int = 0
    seconds: float = 0.0
    longest: float = 0.0

    def describe(self) -> str:
        if not self.calls:
            return "host function never ran"
        return f"host function {self.calls} calls, {self.seconds / self.calls * 1e3:.3f} ms mean, {self.longest * 1e3:.2f} ms longest"
