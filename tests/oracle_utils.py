"""Helpers shared by the oracle tests (`test_format_oracles.py`, `test_upstream_diff.py`)."""

from contextlib import contextmanager

import pytest
import torch

from qwen4_exp_hcu.ple import table as table_module


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so equality is bit equality (-0.0 != 0.0); uint8 for one-byte dtypes."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def finite_e4m3(shape, seed: int, positive: bool = False) -> torch.Tensor:
    """Every finite float8_e4m3fn byte (not the NaNs 0x7F, 0xFF), shuffled and cycled to fill `shape`."""
    codes = torch.tensor([b for b in range(128 if positive else 256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    n = torch.Size(shape).numel()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) % len(codes)
    return codes[order].view(shape).view(torch.float8_e4m3fn)


@contextmanager
def triton_lookups():
    """PLE table lookups of CPU ids run the fused Triton kernel (under TRITON_INTERPRET; on the accelerator
    where there is one) instead of the torch reference they take on the CPU, with the very arguments
    `PLETable.lookup` chose."""
    from qwen4_exp_hcu.kernels.gather_dequant import gather_dequant

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    on = lambda t: None if t is None else t.to(dev)  # noqa: E731

    def kernel(ids, weight, scale, start, global_scale=None):
        d = weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)
        out = torch.full((ids.shape[0], ids.shape[1] * d), float("nan"), dtype=torch.bfloat16, device=dev)
        return gather_dequant(on(ids), on(weight), on(scale), start, out, global_scale=on(global_scale)).cpu()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(table_module, "gather_dequant_reference", kernel)
        yield


@contextmanager
def lookups(path: str):
    """`path` "torch": as is; "triton": `triton_lookups`."""
    if path == "triton":
        with triton_lookups():
            yield
    else:
        yield
