"""INT8 row format of the PLE tables: one bf16 scale per vocab row (compressed-tensors `int-quantized`,
channel strategy). Torch only, so the standalone layers load neither pydantic nor compressed-tensors;
`int8_scheme` parses checkpoint configs with compressed-tensors' classes.

The numbers are those compressed-tensors' channel strategy produces (`calculate_qparams` + `quantize`):
scale = absmax / 127.5 in the weight's dtype, rounded to bf16, zero scales replaced by bf16 eps;
q = round(clamp(w / scale, -128, 127)). Tests hold this file to that oracle bit for bit.
"""

import torch

Q_MIN, Q_MAX = -128, 127
_HALF_RANGE = (Q_MAX - Q_MIN) / 2  # 127.5, compressed-tensors' symmetric divisor
SCALE_DTYPE = torch.bfloat16


@torch.no_grad()
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a `[rows, d]` bf16/fp32 table to int8 rows + bf16 `[rows, 1]` scales."""
    if weight.dim() != 2:
        raise ValueError(f"PLE table must be 2-D [rows, dim], got shape {list(weight.shape)}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"PLE table must be bfloat16 or float32, got {weight.dtype}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("PLE table has non-finite values; they have no INT8 representation")
    # Same ops, same dtypes and same order as compressed-tensors, so rounding matches exactly.
    absmax = weight.abs().amax(dim=1, keepdim=True)
    scale = (absmax / _HALF_RANGE).to(SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.finfo(SCALE_DTYPE).eps, scale)
    q = torch.round(torch.clamp(weight / scale.to(weight.dtype), Q_MIN, Q_MAX)).to(torch.int8)
    return q, scale


@torch.no_grad()
def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`q * scale` in fp32, cast to bf16: the reference the gather/dequant kernels are checked against."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(torch.bfloat16)


def validate_scale(scale: torch.Tensor, rows: int, name: str) -> None:
    """Reject a checkpoint scale that would silently corrupt lookups (0 is legal: all-zero rows)."""
    if scale.dtype != SCALE_DTYPE:
        raise ValueError(f"{name}: scale dtype must be {SCALE_DTYPE}, got {scale.dtype}")
    if tuple(scale.shape) != (rows, 1):
        raise ValueError(f"{name}: scale shape must be [{rows}, 1], got {list(scale.shape)}")
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name}: scale has non-finite values")
    if bool((scale < 0).any()):
        raise ValueError(f"{name}: scale has negative values")


def validate_int8_weight(weight: torch.Tensor, rows: int, dim: int, name: str) -> None:
    """Reject a quantized table whose dtype/shape does not match the model config."""
    if weight.dtype != torch.int8:
        raise ValueError(f"{name}: weight dtype must be torch.int8, got {weight.dtype}")
    if tuple(weight.shape) != (rows, dim):
        raise ValueError(f"{name}: weight shape must be [{rows}, {dim}], got {list(weight.shape)}")
