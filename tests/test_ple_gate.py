"""The PLE gate kernel (`kernels.ple_gate`) against its torch reference, on the CPU under Triton's interpreter and
on a GPU: float32 to float32 rounding, bf16 to two bf16 steps of the largest value (the interpreter truncates
float -> bf16 where a GPU rounds to nearest)."""

import pytest
import torch

from qwen4_exp_hcu.kernels.ple_gate import ple_gate, ple_gate_reference

DEVICES = [pytest.param("cpu", marks=pytest.mark.cpu_only), pytest.param("cuda", marks=pytest.mark.gpu)]
T, HC, H, EPS = 5, 4, 48, 1e-6


def _inputs(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device, dtype)  # noqa: E731
    return r(T, HC * H), r(T, HC * H, scale=3.0), r(T, H), r(HC * H, scale=0.1), r(HC * H, scale=0.1), r(HC * H, scale=0.1)


def _assert_close(got, want):
    if want.dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=2 * 2.0**-7 * want.abs().max().item())
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ple_gate_matches_reference(device, dtype):
    args = (*_inputs(dtype, device), EPS, H)
    for got, want in zip(ple_gate(*args), ple_gate_reference(*args), strict=True):
        _assert_close(got, want)


@pytest.mark.cpu_only
def test_the_tolerance_sees_a_gate_without_its_sign(monkeypatch):
    """The kernel's bf16 output against a reference whose gate drops `sign(g)` (negative gates made positive):
    beyond the tolerance."""
    import qwen4_exp_hcu.kernels.ple_gate as module

    args = (*_inputs(torch.bfloat16, "cpu"), EPS, H)
    got = ple_gate(*args)[0]
    monkeypatch.setattr(module.torch.Tensor, "sign", lambda t: torch.ones_like(t))
    with pytest.raises(AssertionError):
        _assert_close(got, ple_gate_reference(*args)[0])


@pytest.mark.cpu_only
def test_empty_and_mismatched_inputs():
    key, hidden, value, *weights = _inputs(torch.float32, "cpu")
    for gate in (ple_gate, ple_gate_reference):  # a step of no tokens (an ETP rank with no requests)
        assert gate(key[:0], hidden[:0], value[:0], *weights, EPS, H)[1].shape == (0, HC * H)
    with pytest.raises(ValueError, match="ple_gate: key"):
        ple_gate(key, hidden, value[:, :7], *weights, EPS, H)
