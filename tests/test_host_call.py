"""`ple.host_call`: host work in a GPU stream's order. On the GPU the file tier's tests run it inside CUDA graphs
(`tests/test_file_rows.py`); here, what holds on any machine: the C host function runs as the driver calls it, a
Python callback from it is held weakly and a failure there stops the process naming the work (the kernels after it
would read stale rows), the C library builds or fails naming the compiler, and the launcher is the runtime's own
(`cuLaunchHostFunc`, `hipLaunchHostFunc` on ROCm and HCU), a platform without it failing by name."""

import ctypes

import pytest
import torch

from qwen4_exp_hcu.ple.tiers import host_call, stager


def test_a_callback_runs_and_a_method_is_held_weakly():
    """The file tier's rows own their promotion callback: without a cycle between them, they are freed when dropped,
    in the thread that drops them, not by a garbage collection that may run on the driver's thread."""
    import weakref

    class Owner:
        def __init__(self):
            self.seen = 0
            self.callback = host_call.guarded(self.promote, "a test")

        def promote(self):
            self.seen += 1

    owner = Owner()
    owner.callback()  # as the C host function calls it
    assert owner.seen == 1
    callback, gone = owner.callback, weakref.ref(owner)
    del owner
    assert gone() is None  # freed by its reference count alone
    callback()  # a graph replaying it later finds nothing to do


def test_a_callback_runs_with_a_short_switch_interval():
    """A callback gets the GIL back within its interval after each numpy call that gave it up, not 5 ms later."""
    import sys

    seen = []
    before = sys.getswitchinterval()
    host_call.guarded(lambda: seen.append(sys.getswitchinterval()), "a test")()
    assert seen == [pytest.approx(host_call.CALLBACK_SWITCH_INTERVAL_S)] and seen[0] < before == sys.getswitchinterval()


def test_a_failure_stops_the_process_naming_the_work(monkeypatch, caplog):
    stopped = []
    monkeypatch.setattr(host_call.os, "abort", lambda: stopped.append(True))

    def fails():
        raise OSError("file gone")

    host_call.guarded(fails, "PLE rows from files: promoting")()
    assert stopped == [True]
    assert "PLE rows from files: promoting failed" in caplog.text and "file gone" in caplog.text


def test_the_host_function_is_c_and_runs_as_the_driver_calls_it():
    """The host node's function is `qwen4_ple_stage_call(Call *)` of the built library: called through its address
    with a `Call` (a retired stager, as after its rows are gone: nothing to do) it returns, and needs no GIL."""
    function = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(stager.host_function())
    state = stager.Stager(alive=0)
    call = stager.Call(ctypes.pointer(state), 5, 0)
    function(ctypes.addressof(call))
    assert state.calls == 0


def test_no_c_compiler_fails_naming_it(monkeypatch, tmp_path):
    monkeypatch.setattr(stager, "_LIB", None)
    monkeypatch.setenv(stager.CACHE_ENV, str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(stager.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"need a C compiler \(CC=/nonexistent/cc is not one\).*stage.c"):
        stager.library()


def test_a_cache_that_cannot_be_written_fails_naming_the_setting(monkeypatch, tmp_path):
    monkeypatch.setattr(stager, "_LIB", None)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(stager.CACHE_ENV, str(tmp_path / "file" / "cache"))  # under a file: no directory there
    with pytest.raises(RuntimeError, match=r"cannot build their host function into .*set QWEN4_EXP_HCU_CACHE"):
        stager.library()


def test_the_library_builds_once_into_its_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(stager, "_LIB", None)
    monkeypatch.setenv(stager.CACHE_ENV, str(tmp_path))
    stager.library()
    built = list(tmp_path.glob("stage-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(stager, "_LIB", None)
    monkeypatch.setattr(stager.subprocess, "run", None)  # a second load compiles nothing
    stager.library()


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
