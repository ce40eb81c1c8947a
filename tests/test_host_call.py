"""`ple.host_call`: host work in a GPU stream's order. On the GPU the file tier's tests run it inside CUDA graphs
(`tests/test_file_rows.py`); here, what holds on any machine: the trampoline hands its argument over, a failure
stops the process naming the work (the kernels after it would read stale rows), and the launcher is the
runtime's own (`cuLaunchHostFunc`, `hipLaunchHostFunc` on ROCm and HCU), a platform without it failing by name."""

import ctypes

import pytest
import torch

from qwen4_exp_hcu.ple import host_call


def test_the_host_function_gets_its_argument():
    seen = []
    call = host_call.HostCall(seen.append, "a test")
    call._trampoline(ctypes.c_void_p(2 * 1234 + 1))  # as the driver calls it
    call._trampoline(None)  # a null pointer is 0
    assert seen == [2469, 0]
    assert call.stats.calls == 2 and 0 < call.stats.longest <= call.stats.seconds  # its own time, for reports
    assert call.stats.describe().startswith("host function 2 calls")


def test_a_method_is_held_weakly():
    """The file tier's rows own their host call: without a cycle between them, they are freed when dropped, in the
    thread that drops them, not by a garbage collection that may run on the driver's thread."""
    import weakref

    class Owner:
        def __init__(self):
            self.seen = []
            self.call = host_call.HostCall(self.stage, "a test")

        def stage(self, arg):
            self.seen.append(arg)

    owner = Owner()
    owner.call._trampoline(ctypes.c_void_p(6))
    assert owner.seen == [6]
    trampoline, gone = owner.call._trampoline, weakref.ref(owner)
    del owner
    assert gone() is None  # freed by its reference count alone
    trampoline(ctypes.c_void_p(8))  # a graph replaying it later finds nothing to do


def test_a_failure_stops_the_process_naming_the_work(monkeypatch, caplog):
    stopped = []
    monkeypatch.setattr(host_call.os, "abort", lambda: stopped.append(True))

    def fails(arg):
        raise OSError(f"file gone ({arg})")

    host_call.HostCall(fails, "PLE rows from files: staging")._trampoline(ctypes.c_void_p(7))
    assert stopped == [True]
    assert "PLE rows from files: staging failed" in caplog.text and "file gone (7)" in caplog.text


class _Library:
    def __init__(self, name, symbols):
        self.name = name
        for symbol in symbols:
            setattr(self, symbol, ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0))


@pytest.mark.parametrize("hip, library, symbol", [(None, "libcuda.so.1", "cuLaunchHostFunc"),
                                                  ("6.2", "libamdhip64.so", "hipLaunchHostFunc")])  # fmt: skip
def test_the_launcher_is_the_runtimes(monkeypatch, hip, library, symbol):
    monkeypatch.setattr(host_call, "_LAUNCH", None)
    monkeypatch.setattr(torch.version, "hip", hip)
    opened = []

    def cdll(name):
        opened.append(name)
        return _Library(name, [symbol])

    monkeypatch.setattr(host_call.ctypes, "CDLL", cdll)
    host_call.launcher()
    assert opened == [library]


def test_a_runtime_without_host_functions_fails_naming_the_symbol(monkeypatch):
    monkeypatch.setattr(host_call, "_LAUNCH", None)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(host_call.ctypes, "CDLL", lambda name: _Library(name, []))  # libraries load, no symbol
    with pytest.raises(RuntimeError, match="need hipLaunchHostFunc .*libamdhip64.so.*libgalaxyhip.so"):
        host_call.launcher()
