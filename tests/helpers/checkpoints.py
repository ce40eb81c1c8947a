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
    `fp8` (e4m3 rows + ONE table-level `weight_scale` of `scale_dtype`, [1], as the FP8 release stores it) or
    `nvfp4` (packed e2m1 + e4m3 block `weight_scale` + ONE table-level fp32 `weight_scale_2`); `oracle`: SRC
    with the tables' dequantized values. Written and decoded without our quantizer or formats module: torch's
    float8 dtype and compressed-tensors' FP4 packing (`helpers.oracles`)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from helpers.oracles import fp8_rows, nvfp4_quantize, nvfp4_rows

    tensors = load_file(src / "model.safetensors")
    shards = [k for k in tensors if ".ngram_embedding.shard_" in k and k.endswith(".weight")]
    tables = {k.rsplit(".shard_", 1)[0] for k in shards}
    amax = max(tensors[k].float().abs().max() for k in shards)
    quantized, dequantized = dict(tensors), dict(tensors)
    if fmt == "fp8":
        scale = (amax / 448).reshape(1).to(scale_dtype)
        quantized.update({f"{t}.weight_scale": scale.clone() for t in tables})
        for k in shards:
            quantized[k] = (tensors[k].float() / scale.float()).to(torch.float8_e4m3fn)
            dequantized[k] = fp8_rows(quantized[k], scale)
        declared = "float8_e4m3fn"
    else:
        scale = (amax / (448 * 6)).reshape(1).float()
        quantized.update({f"{t}.weight_scale_2": scale.clone() for t in tables})
        for k in shards:
            quantized[k], quantized[k + "_scale"] = nvfp4_quantize(tensors[k], scale)
            dequantized[k] = nvfp4_rows(quantized[k], quantized[k + "_scale"], scale)
        declared = "nvfp4"
    for path, weights in ((dst, quantized), (oracle, dequantized)):
        shutil.copytree(src, path)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "ple_embedding_dtype": declared}, indent=2))
    return dst


# How much sharper `sharpen_attention` makes the attention and the QSA indexer: their zero-centred q/k norms scaled
# by these factors. With random weights attention is almost uniform, so which blocks QSA keeps hardly matters;
# sharpened, each query leans on a few keys anywhere in the context, and attending to all of them (dense) instead
# of the indexer's blocks moves the logprobs by ~10x transformers' own bf16 noise at 3k-8k tokens (4 and 4: dense
# against QSA 0.109 / 0.145 / 0.168 mean at 3000 / 5000 / 8000 tokens, bf16 against fp32 0.0097 / 0.018 / 0.0099).
SHARP_ATTENTION, SHARP_INDEXER = 4.0, 4.0
_SHARPENED = {
    "self_attn.q_norm.weight": SHARP_ATTENTION, "self_attn.k_norm.weight": SHARP_ATTENTION,
    "indexer.q_layernorm.weight": SHARP_INDEXER, "indexer.k_layernorm.weight": SHARP_INDEXER,
}  # fmt: skip


def sharpen_attention(checkpoint: Path) -> Path:
    """Scale the attention's and the indexer's q/k norms of `checkpoint` in place (`SHARP_*`). The norms are
    zero-centred (`x * (1 + w)`), so `1 + w` is what scales."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        tensors = load_file(path)
        factors = {k: f for k in tensors for suffix, f in _SHARPENED.items() if k.endswith(suffix)}
        if factors:
            tensors.update({k: ((1 + tensors[k].float()) * f - 1).to(tensors[k].dtype) for k, f in factors.items()})
            save_file(tensors, path, metadata=metadata)
    return Path(checkpoint)
