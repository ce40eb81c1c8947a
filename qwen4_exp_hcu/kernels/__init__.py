"""Triton kernels (CUDA/ROCm, and CPU under TRITON_INTERPRET=1): each file holds a kernel, its launcher and its
torch reference; `dispatch` picks between launcher and reference for the library."""

from __future__ import annotations

from collections.abc import Callable

import torch


def dispatch(
    launcher: Callable, reference: Callable, *args, out: torch.Tensor | None = None, options: dict | None = None, **kwargs
) -> torch.Tensor:
    """`launcher(*args, **kwargs, out=out, **options)` when the first tensor in `args` is on an accelerator, else
    `reference(*args, **kwargs)`, copied into `out` when given: serving on the CPU never pays for Triton's
    interpreter (the tests run the launchers under it), and under torch.compile Inductor fuses the reference's
    ops itself. `options`: the launcher's alone (tuning, a cache)."""
    if torch.compiler.is_compiling() or next(a for a in args if isinstance(a, torch.Tensor)).device.type == "cpu":
        result = reference(*args, **kwargs)
        return result if out is None else out.copy_(result)
    if out is not None:
        kwargs["out"] = out
    return launcher(*args, **kwargs, **(options or {}))
