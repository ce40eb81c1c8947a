"""PLE table row formats besides INT8 (`int8`), in upstream vLLM's checkpoint layout, with their torch references.

* `fp8`: float8 e4m3 rows (`shard_{j}.weight`) and one scale for the whole table
  (`ngram_embedding.weight_scale`): `w = bf16(e4m3) * bf16(scale)`, multiplied in bf16 as upstream does.
* `nvfp4`: e2m1 values packed two per byte (`shard_{j}.weight` uint8 `[rows, d/2]`, low nibble = even
  column), one e4m3 scale per 16 values (`shard_{j}.weight_scale` `[rows, d/16]`) and one scale for the
  whole table (`ngram_embedding.weight_scale_2`): `w = (e2m1 * block_scale) * weight_scale_2`, in that order.
Every dequantization ends with one fp32 -> bf16 rounding (to nearest even), which the fused kernel
reproduces bit for bit (an e4m3 value times a bf16 scale is exact in fp32). `quantize_nvfp4_rows` writes the
NVFP4 layout (the quantizer's 4-bit output).
"""

from __future__ import annotations

import torch

NVFP4_BLOCK = 16
# e2m1 magnitudes by code & 7 (sign in bit 3)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def table_format(weight: torch.Tensor, scale: torch.Tensor | None) -> str:
    """The row format a (weight, scale) pair is stored in, from their dtypes."""
    if weight.dtype == torch.bfloat16 and scale is None:
        return "bf16"
    if weight.dtype == torch.int8:
        return "int8"
    if weight.dtype == torch.float8_e4m3fn:
        return "fp8"
    if weight.dtype == torch.uint8 and scale is not None and scale.dtype == torch.float8_e4m3fn:
        return "nvfp4"
    raise ValueError(f"PLE table: no row format stores weight {weight.dtype} with scale {getattr(scale, 'dtype', None)}.")


def row_width(weight: torch.Tensor, fmt: str) -> int:
    """Values per row (a packed NVFP4 byte holds two)."""
    return weight.shape[-1] * (2 if fmt == "nvfp4" else 1)


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Upstream's arithmetic: both factors in bf16 (e4m3 -> bf16 is exact; the scale is rounded), one rounding."""
    return weight.to(torch.bfloat16) * scale.to(torch.bfloat16).reshape(())


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., d/2]` -> fp32 `[..., d]` e2m1 values (low nibble first)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = _E2M1.to(packed.device)[codes & 7]
    return torch.where(codes >= 8, -values, values)


def dequantize_nvfp4_rows(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    values = unpack_e2m1(packed) * block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return (values * global_scale.float().reshape(())).to(torch.bfloat16)


E4M3_MAX, E2M1_MAX = 448.0, 6.0


def nvfp4_tensor_scale(amax: float) -> torch.Tensor:
    """fp32 `weight_scale_2` for a table whose largest magnitude is `amax`: the largest block scale fits e4m3."""
    return torch.tensor([max(amax, 1e-12) / (E4M3_MAX * E2M1_MAX)], dtype=torch.float32)


def quantize_nvfp4_rows(rows: torch.Tensor, tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] rows -> (packed e2m1 uint8 [n, d/2], e4m3 block scales [n, d/16]): each block scaled so its
    largest magnitude maps to e2m1's 6, every value rounded to the nearest e2m1 code (ties to the lower)."""
    blocks = rows.float().unflatten(-1, (-1, NVFP4_BLOCK))
    g = tensor_scale.float().reshape(())
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX / g).clamp(2**-9, E4M3_MAX).to(torch.float8_e4m3fn)
    x = blocks / (block_scale.float() * g)[..., None]
    code = (x.abs()[..., None] - _E2M1.to(rows.device)).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.flatten(-2).to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), block_scale
