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
def upstream_table_checkpoints(src: Path, dst: Path, oracle: Path, fmt: str) -> Path:
    """`dst`: SRC with its PLE tables in upstream vLLM's `fmt` layout, declared by `ple_embedding_dtype`:
    `fp8` (e4m3 rows + one fp32 `weight_scale`, written here) or `nvfp4` (packed e2m1 + e4m3 block
    `weight_scale` + fp32 `weight_scale_2`, written by our quantizer); `oracle`: SRC with the tables'
    dequantized values."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from qwen4_exp_hcu.ple.formats import dequantize_fp8_rows, dequantize_nvfp4_rows
    from qwen4_exp_hcu.quantize import quantize_checkpoint

    tensors = load_file(src / "model.safetensors")
    tables = [k for k in tensors if ".ngram_embedding.shard_" in k and k.endswith(".weight")]
    if fmt == "nvfp4":
        quantize_checkpoint(src, dst, "nvfp4")
        q = load_file(dst / "model.safetensors")
        dequantized = {**tensors, **{k: dequantize_nvfp4_rows(q[k], q[k + "_scale"], q[k + "_scale_2"]) for k in tables}}
    else:
        amax = max(tensors[k].float().abs().max() for k in tables)
        scale = (amax / 448).reshape(1)
        quantized = {**tensors, **{k: (tensors[k].float() / scale).to(torch.float8_e4m3fn) for k in tables}}
        quantized.update({k + "_scale": scale.clone() for k in tables})
        dequantized = {**tensors, **{k: dequantize_fp8_rows(quantized[k], scale) for k in tables}}
        shutil.copytree(src, dst)
        save_file(quantized, dst / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "ple_embedding_dtype": "float8_e4m3fn"}, indent=2))
    shutil.copytree(src, oracle)
    save_file(dequantized, oracle / "model.safetensors", metadata={"format": "pt"})
    return dst
