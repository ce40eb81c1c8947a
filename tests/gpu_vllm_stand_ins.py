"""Torch stand-ins for vLLM 0.33 compiled ops that GPU runs of this repo reach through `../shared/gpu-vllm`
(its Python-only engine; `setup.sh` loads this file). Environment plumbing for that tool, never package code:
real deployments have vLLM's compiled ops. Each is capture-safe (no host syncs) and writes into its outputs.
"""

import torch


def per_token_group_fp8_quant(x, x_q, x_s, group_size, eps, fp8_min, fp8_max, use_ue8m0,
                              column_major_scales=False, tma_aligned_scales=False):  # fmt: skip
    """Block-FP8 activations (the FP8 release's routed experts): per group of `group_size` values, scale =
    amax / fp8_max (a power of two, rounded up, with `use_ue8m0`), x_q = x / scale clamped to e4m3. `x_s`
    may be a column-major view; `copy_` writes through its strides."""
    groups = x.float().unflatten(-1, (-1, group_size))
    scale = groups.abs().amax(-1).clamp_min(eps) / fp8_max
    if use_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    x_q.copy_((groups / scale[..., None]).clamp(fp8_min, fp8_max).flatten(-2).to(x_q.dtype))
    x_s.copy_(scale)


def silu_and_mul_per_block_quant(out, x, scales, group_size, scale_ub=None, is_scale_transposed=False):
    """The FP8 release's expert activation: silu(gate) * up of `x` = [gate || up], then block-FP8 quantized
    per `group_size` values as above (scale capped by `scale_ub` when given)."""
    gate, up = x.float().chunk(2, dim=-1)
    groups = (torch.nn.functional.silu(gate) * up).unflatten(-1, (-1, group_size))
    fp8_max = torch.finfo(out.dtype).max
    scale = groups.abs().amax(-1).clamp_min(1e-10) / fp8_max
    if scale_ub is not None:
        scale = torch.minimum(scale, scale_ub.float())
    out.copy_((groups / scale[..., None]).clamp(-fp8_max, fp8_max).flatten(-2).to(out.dtype))
    scales.copy_(scale)


C_OPS = {
    "per_token_group_fp8_quant": per_token_group_fp8_quant,
    "silu_and_mul_per_block_quant": silu_and_mul_per_block_quant,
}
MOE_OPS = {}
