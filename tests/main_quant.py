"""Tiny checkpoints whose main model is quantized by compressed-tensors' own compressors (W8A8-INT8,
W8A8-FP8, W4A16), and the weight-dequantized copy transformers runs as their oracle."""

from pathlib import Path

import torch

MAIN_TARGETS = [  # the big linears; hyper-connections, routers, GDN input projections and PLE stay BF16
    r"re:.*self_attn\.(q|k|v|o)_proj$",
    r"re:.*shared_expert\.(gate|up|down)_proj$",
    r"re:.*linear_attn\.out_proj$",
]


def _scheme(name: str):
    """(weights args, activations args, compressed format) of a main-model scheme."""
    from compressed_tensors.quantization import QuantizationArgs

    if name == "w8a8":  # int8 channel weights, dynamic per-token int8 activations
        weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        return weights, acts, "int-quantized"
    if name == "w8a8_fp8":  # float8 e4m3 channel weights, dynamic per-token float8 activations
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        return weights, acts, "float-quantized"
    if name == "w4a16":  # int4 weights in groups of 32, bf16 activations
        return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32), None, "pack-quantized"
    raise ValueError(name)


@torch.no_grad()
def quantize_main(src: Path, dst: Path, dequantized: Path, scheme: str = "w8a8") -> Path:
    """`dst`: SRC with its main linears quantized by `scheme`, written by compressed-tensors'
    `ModelCompressor`; `dequantized`: the same weights as BF16, as compressed-tensors' fake quantization
    gives them."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    weights, acts, fmt = _scheme(scheme)
    config = QuantizationScheme(targets=MAIN_TARGETS, weights=weights, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": config}, format=fmt))
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.float()
        grouped = w.unflatten(-1, (-1, weights.group_size)) if weights.strategy == "group" else w[:, None, :]
        scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), weights)
        module.weight_scale.copy_(scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype))
        # The oracle's weights: what the compressed weights dequantize to.
        zero = getattr(module, "weight_zero_point", torch.zeros_like(module.weight_scale))
        deq = fake_quantize(w, module.weight_scale.float(), zero, weights)
        reference.get_submodule(name).weight.copy_(deq.to(torch.bfloat16))
    reference.save_pretrained(dequantized)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for path in (dst, dequantized):
        AutoTokenizer.from_pretrained(src).save_pretrained(path)
    return dst


@torch.no_grad()
def upstream_table_checkpoints(src: Path, dst: Path, oracle: Path, fmt: str, scale_dtype=torch.bfloat16) -> Path:
    """`dst`: SRC with its PLE tables in upstream vLLM's `fmt` layout, declared by `ple_embedding_dtype`:
    `fp8` (e4m3 rows + ONE table-level `weight_scale` of `scale_dtype`, [1], as the FP8 release stores it;
    written here) or `nvfp4` (packed e2m1 + e4m3 block `weight_scale` + ONE table-level fp32 `weight_scale_2`,
    written by our quantizer); `oracle`: SRC with the tables' dequantized values, computed from the stored
    codes by compressed-tensors' FP4 decode (NVFP4) and torch's float8 dtype (FP8), not by our dequantizers."""
    import json
    import shutil

    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from safetensors.torch import load_file, save_file

    from qwen4_exp_hcu.quantize import quantize_checkpoint

    tensors = load_file(src / "model.safetensors")
    tables = [k for k in tensors if ".ngram_embedding.shard_" in k and k.endswith(".weight")]
    table_scale = {t.rsplit(".shard_", 1)[0] for t in tables}
    if fmt == "nvfp4":
        quantize_checkpoint(src, dst, "nvfp4")
        q = load_file(dst / "model.safetensors")

        def rows(k):
            packed, block = q[k], q[k + "_scale"].float()
            values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            g = q[k.rsplit(".shard_", 1)[0] + ".weight_scale_2"].float()
            return (values * block.repeat_interleave(16, -1) * g).to(torch.bfloat16)

        dequantized = {**tensors, **{k: rows(k) for k in tables}}
    else:
        amax = max(tensors[k].float().abs().max() for k in tables)
        scale = (amax / 448).reshape(1).to(scale_dtype)
        quantized = {**tensors, **{k: (tensors[k].float() / scale.float()).to(torch.float8_e4m3fn) for k in tables}}
        quantized.update({f"{t}.weight_scale": scale.clone() for t in table_scale})
        # upstream's arithmetic: both factors in bf16, one rounding
        dequantized = {**tensors, **{k: quantized[k].to(torch.bfloat16) * scale.to(torch.bfloat16) for k in tables}}
        shutil.copytree(src, dst)
        save_file(quantized, dst / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "ple_embedding_dtype": "float8_e4m3fn"}, indent=2))
    shutil.copytree(src, oracle)
    save_file(dequantized, oracle / "model.safetensors", metadata={"format": "pt"})
    return dst
