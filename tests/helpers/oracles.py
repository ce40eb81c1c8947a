"""Helpers shared by the oracle tests (`test_format_oracles.py`, `test_upstream_diff.py`)."""

from contextlib import contextmanager

from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

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

    def kernel(ids, weight, scale, start, global_scale=None, **layout):
        d = weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)
        out = torch.full((ids.shape[0], ids.shape[1] * d), float("nan"), dtype=torch.bfloat16, device=dev)
        return gather_dequant(on(ids), on(weight), on(scale), start, out, global_scale=on(global_scale), **layout).cpu()

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


# ---- upstream-layout tables written and read without our formats module ------------------------------------
def fp8_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Upstream's FP8 dequantization, from torch's float8 dtype: both factors in bf16, one rounding."""
    return weight.to(torch.bfloat16) * scale.to(torch.bfloat16).reshape(())


def nvfp4_rows(packed: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """NVFP4 rows decoded by compressed-tensors' FP4 helper: (e2m1 * block scale) * table scale in fp32, bf16."""
    values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    return (values * block_scale.float().repeat_interleave(16, dim=-1) * scale_2.float().reshape(())).to(torch.bfloat16)


def nvfp4_quantize(rows: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] rows -> (packed e2m1, e4m3 block scales) with compressed-tensors' FP4 packing (nearest code);
    block scale = block amax / 6 / table scale, as NVFP4 defines it."""
    blocks = rows.float().unflatten(-1, (-1, 16))
    block_scale = (blocks.abs().amax(-1) / 6.0 / scale_2.float()).clamp(2**-9, 448.0).to(torch.float8_e4m3fn)
    values = (blocks / (block_scale.float() * scale_2.float())[..., None]).clamp(-6.0, 6.0).flatten(-2)
    return pack_fp4_to_uint8(values), block_scale
