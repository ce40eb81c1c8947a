"""One PLE layer's checkpoint tensors with random values, and transformers' layer beside ours built from them."""

import torch
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

from qwen4_exp_hcu.names import HASH_BUFFERS, LAYER_PARAMS, SCALE_SUFFIX, SHARD, TABLE, ple_layers
from qwen4_exp_hcu.ple.formats.int8 import dequantize_rows, quantize_rows
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.storage import PLEStorage


def _transformers_layer(cfg, ple_index: int) -> Qwen4ExpTextPLELayer:
    return Qwen4ExpTextPLELayer(cfg, ple_layers(cfg)[ple_index].decoder, ple_index).float()


def ple_state_dict(cfg, ple_index: int = 1, quantized: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one PLE layer, named relative to `model.layers.{i}.ple.` as the releases store
    them: transformers' hash buffers, the layer parameters at transformers' shapes, and the table in
    `split_ngram_parts` row shards, BF16 or, `quantized`, INT8 with row scales. Random values, std 0.3."""
    hf = _transformers_layer(cfg, ple_index)
    g = torch.Generator().manual_seed(seed)
    sd = {f"ple_embedding.{name}": hf.ple_embedding.get_buffer(name) for name in HASH_BUFFERS}
    sd |= {name: torch.randn(hf.get_parameter(name).shape, generator=g) * 0.3 for name in LAYER_PARAMS}
    table = (torch.randn(hf.get_parameter(f"{TABLE}.weight").shape, generator=g) * 0.3).to(torch.bfloat16)
    q, s = quantize_rows(table)
    n = -(-table.shape[0] // cfg.split_ngram_parts)
    for j in range(cfg.split_ngram_parts):
        rows, name = slice(j * n, (j + 1) * n), f"{TABLE}.shard_{j}.weight"
        if quantized:
            sd[name], sd[f"{TABLE}.shard_{j}.{SCALE_SUFFIX}"] = q[rows].clone(), s[rows].clone()
        else:
            sd[name] = table[rows].clone()
    return sd


def save_state_dicts(state_dicts: list[dict[str, torch.Tensor]], path) -> None:
    """Several layers' `ple_state_dict`s in one safetensors file (keys `{i}/{name}`), for worker processes."""
    from safetensors.torch import save_file

    flat = {f"{i}/{k}": v.clone(memory_format=torch.contiguous_format)
            for i, sd in enumerate(state_dicts) for k, v in sd.items()}  # fmt: skip
    save_file(flat, str(path))


def load_state_dicts(path) -> list[dict[str, torch.Tensor]]:
    """What `save_state_dicts` wrote, in its order."""
    from safetensors.torch import load_file

    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path)).items():
        i, name = key.split("/", 1)
        layers.setdefault(int(i), {})[name] = value
    return [layers[i] for i in sorted(layers)]


def make_pair(cfg, ple_index=1, quantized=False, seed=0, **storage):
    """(transformers layer in fp32, our layer) loaded from one `ple_state_dict`; transformers' table holds
    the rows our shards decode to (INT8: dequantized), so both compute the same function. Seeds the global
    RNG with `seed` first, so the inputs callers draw from it after are reproducible. `storage`: `PLEStorage` fields."""
    torch.manual_seed(seed)
    sd = ple_state_dict(cfg, ple_index, quantized, seed)
    shards = [
        dequantize_rows(sd[f"{TABLE}.shard_{j}.weight"], sd[f"{TABLE}.shard_{j}.{SCALE_SUFFIX}"]) if quantized
        else sd[f"{TABLE}.shard_{j}.weight"]
        for j in range(cfg.split_ngram_parts)
    ]  # fmt: skip
    hf = _transformers_layer(cfg, ple_index)
    hf.load_state_dict({k: v for k, v in sd.items() if not SHARD.search(k)} | {f"{TABLE}.weight": torch.cat(shards).float()})
    ours = PLELayer.from_state_dict(cfg, ple_index, sd, storage=PLEStorage("int8" if quantized else "bf16", **storage), dtype=torch.float32)
    return hf, ours
