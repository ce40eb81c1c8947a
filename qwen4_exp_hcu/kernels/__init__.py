"""Triton kernels (CUDA/ROCm, and CPU under TRITON_INTERPRET=1): each file holds a kernel, its launcher and its
torch reference; `dispatch` picks between launcher and reference for the library."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from qwen4_exp_hcu.env import TORCH_OPS_ENV

SWAPPABLE = frozenset(
    {"down_silu", "gate_mix", "inject_norm", "ngram_hash", "ple_gate", "scaled_silu", "short_conv", "store_window"}
)
"""The kernels `QWEN4_EXP_HCU_TORCH_OPS` may swap for their torch references on an accelerator. Not the table
gather: its reference would index a host table from the GPU."""
CAPTURABLE = frozenset({"down_silu"})
"""Swaps CUDA graphs capture: `down_silu`'s is the GEMM library's path, the model's own at larger batches."""


def torch_ops() -> frozenset[str]:
    """The kernels `QWEN4_EXP_HCU_TORCH_OPS` names; an unknown name is an error (the plugin asks at start-up)."""
    return _parse_torch_ops(os.environ.get(TORCH_OPS_ENV, ""))


@functools.cache
def _parse_torch_ops(value: str) -> frozenset[str]:
    names = frozenset(n for n in value.replace(",", " ").split())
    if names == {"all"}:
        return SWAPPABLE
    if names - SWAPPABLE:
        raise ValueError(f"{TORCH_OPS_ENV}={value!r}: unknown kernel(s) {sorted(names - SWAPPABLE)}; "
                         f"it takes 'all' or any of {sorted(SWAPPABLE)}")  # fmt: skip
    return names


def dispatch(
    launcher: Callable, reference: Callable, *args, out: torch.Tensor | None = None, options: dict | None = None, **kwargs
) -> torch.Tensor:
    """`launcher(*args, **kwargs, out=out, **options)` when the first tensor in `args` is on an accelerator, else
    `reference(*args, **kwargs)`, copied into `out` when given: serving on the CPU never pays for Triton's
    interpreter (the tests run the launchers under it), and under torch.compile Inductor fuses the reference's
    ops itself; and where `QWEN4_EXP_HCU_TORCH_OPS` names the launcher. `options`: the launcher's alone
    (tuning, a cache)."""
    on_cpu = next(a for a in args if isinstance(a, torch.Tensor)).device.type == "cpu"
    if torch.compiler.is_compiling() or on_cpu or launcher.__name__ in torch_ops():
        result = reference(*args, **kwargs)
        return result if out is None else out.copy_(result)
    if out is not None:
        kwargs["out"] = out
    return launcher(*args, **kwargs, **(options or {}))
