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
    """`dst`: SRC with its PLE tables in upstream vLLM's `fmt` layout (`fp8`: e4m3 rows + one fp32
    `weight_scale`; `nvfp4`: packed e2m1 + e4m3 block `weight_scale` + fp32 `weight_scale_2`, repeated in
    every shard) declared by `ple_embedding_dtype`; `oracle`: SRC with the tables' dequantized values."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from qwen4_exp_hcu.ple.formats import NVFP4_BLOCK, dequantize_fp8_rows, dequantize_nvfp4_rows

    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    tensors = load_file(src / "model.safetensors")
    tables = [k for k in tensors if ".ngram_embedding.shard_" in k and k.endswith(".weight")]
    amax = max(tensors[k].float().abs().max() for k in tables)
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in tables:
        w = tensors[name].float()
        if fmt == "fp8":
            scale = (amax / 448).reshape(1)
            q = (w / scale).to(torch.float8_e4m3fn)
            quantized[name], quantized[name + "_scale"] = q, scale
            dequantized[name] = dequantize_fp8_rows(q, scale)
        else:
            scale_2 = (amax / (448 * 6)).reshape(1)
            blocks = w.unflatten(-1, (-1, NVFP4_BLOCK))
            block = (blocks.abs().amax(-1) / 6 / scale_2).clamp_min(2**-9).to(torch.float8_e4m3fn)
            x = blocks / (block.float() * scale_2)[..., None]
            code = (x.abs()[..., None] - e2m1).abs().argmin(-1) | ((x < 0).long() << 3)  # nearest e2m1
            code = code.flatten(-2).to(torch.uint8)
            packed = code[:, 0::2] | (code[:, 1::2] << 4)
            quantized[name], quantized[name + "_scale"], quantized[name + "_scale_2"] = packed, block, scale_2
            dequantized[name] = dequantize_nvfp4_rows(packed, block, scale_2)
    for path, data in ((dst, quantized), (oracle, dequantized)):
        shutil.copytree(src, path)
        save_file(data, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["ple_embedding_dtype"] = {"fp8": "float8_e4m3fn", "nvfp4": "nvfp4"}[fmt]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
