"""The file tier's per-lookup host work as C (`stage.c`), built once per machine with the system's C compiler
(`CC`, else `cc`: the one Triton builds its launchers with) into a cache, and loaded with ctypes. A host node that
runs Python waits for the GIL while the engine's thread runs Python; this one does not (`stage.c` says how much
that cost)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from qwen4_exp_hcu.env import CACHE_ENV
from qwen4_exp_hcu.ple.tiers.host_call import CALLBACK

SOURCE = Path(__file__).with_name("stage.c")

_i64, _p = ctypes.c_int64, ctypes.c_void_p
ASK_PAGES_FIRST = ("never", "after_a_fault", "always")  # `Stager.ask_first`: stage.c's ASK_*, in order


class Stager(ctypes.Structure):
    """`Stager` of `stage.c`, field for field."""

    _fields_ = [("start", _i64), ("n", _i64), ("shard_rows", _i64), ("first_shard", _i64),
                ("n_parts", _i64), ("slots", _i64), ("slot_of", _p), ("src", _p), ("dst", _p), ("row_bytes", _p),
                ("counts", _p), ("fresh", _p), ("fresh_len", _i64), ("fresh_cap", _i64), ("lookups", _i64),
                ("refresh_every", _i64), ("promote", CALLBACK), ("ids", _p), ("cached", _p), ("slot", _p),
                ("keys", _p), ("vals", _p), ("table_size", _i64), ("calls", _i64), ("ns", _i64),
                ("longest_ns", _i64), ("alive", _i64), ("ask_first", _i64), ("pages_asked", _i64),
                ("in_memory", _i64)]  # fmt: skip


class Call(ctypes.Structure):
    """A host node's argument: the stager and the lookup's size (fixed per captured graph)."""

    _fields_ = [("stager", ctypes.POINTER(Stager)), ("n", _i64), ("flagged", _i64)]


_LIB: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """`stage.c` built (once per source and machine, kept under `QWEN4_EXP_HCU_CACHE`) and loaded. No C compiler:
    an error at load that says so."""
    global _LIB
    if _LIB is None:
        source = SOURCE.read_bytes()
        cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "qwen4_exp_hcu")
        built = cache / f"stage-{hashlib.sha256(source + os.uname().machine.encode()).hexdigest()[:16]}.so"
        if not built.exists():
            compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
            if compiler is None:
                raise RuntimeError(f"PLE rows from files need a C compiler (CC={os.environ.get('CC') or 'cc'} is not one) to "
                                   f"build {SOURCE}, their per-lookup host work.")  # fmt: skip
            partial = built.with_suffix(f".{os.getpid()}.tmp")  # ranks building at once each rename a whole file
            try:
                cache.mkdir(parents=True, exist_ok=True)
                done = subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-o", str(partial), str(SOURCE)], capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"PLE rows from files: building {SOURCE} with {compiler} failed:\n{done.stderr}")
                os.replace(partial, built)
            except OSError as e:
                raise RuntimeError(f"PLE rows from files: cannot build their host function into {cache} ({e}); set "
                                   f"{CACHE_ENV} to a writable directory.") from e  # fmt: skip
        lib = ctypes.CDLL(str(built))
        lib.qwen4_ple_stage.argtypes, lib.qwen4_ple_stage.restype = [ctypes.POINTER(Stager), _i64, _i64], None
        lib.qwen4_ple_stager_bytes.restype = _i64
        if lib.qwen4_ple_stager_bytes() != ctypes.sizeof(Stager):  # a field added on one side only
            raise RuntimeError(f"{SOURCE}'s Stager has {lib.qwen4_ple_stager_bytes()} bytes, its mirror in {__file__} "
                               f"{ctypes.sizeof(Stager)}: they must list the same fields.")  # fmt: skip
        _LIB = lib
    return _LIB


def host_function() -> int:
    """The address of `qwen4_ple_stage_call(Call *)`, the function a host node runs."""
    return ctypes.cast(library().qwen4_ple_stage_call, _p).value
