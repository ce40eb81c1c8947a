"""Tiny checkpoints whose main model is quantized by compressed-tensors' own compressors (W8A8-INT8), and
the weight-dequantized copy transformers runs as their oracle."""

from pathlib import Path

import torch

W8A8_TARGETS = [  # the big linears; hyper-connections, routers, GDN input projections and PLE stay BF16
    r"re:.*self_attn\.(q|k|v|o)_proj$",
    r"re:.*shared_expert\.(gate|up|down)_proj$",
    r"re:.*linear_attn\.out_proj$",
]


@torch.no_grad()
def quantize_main_w8a8(src: Path, dst: Path, dequantized: Path) -> Path:
    """`dst`: SRC with W8A8-INT8 main linears (int8 channel weights, dynamic per-token int8 activations),
    written by compressed-tensors' `ModelCompressor`; `dequantized`: the same weights as BF16 `q * scale`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=W8A8_TARGETS, weights=weights, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized"))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.float()
        scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), weights)
        module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
    # The oracle's weights: what the compressed int8 weights dequantize to (fake-quantized in place).
    reference = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            s = module.weight_scale.float()
            q = torch.round(torch.clamp(module.weight.float() / s, -128, 127))
            reference.get_submodule(name).weight.copy_((q * s).to(torch.bfloat16))
    reference.save_pretrained(dequantized)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for path in (dst, dequantized):
        AutoTokenizer.from_pretrained(src).save_pretrained(path)
    return dst
