"""Build PLE layers straight from a transformers-format checkpoint directory (notebooks, benchmarks).

Tensors are read one at a time with safetensors (no pickle), so PLE shards stream into the table's
final storage; BF16, INT8 (compressed-tensors) and upstream's FP8 / NVFP4 layouts alike, declared as the
checkpoint's config declares them (`ple.declaration`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from qwen4_exp_hcu.names import TEXT_PREFIXES, ple_layers
from qwen4_exp_hcu.ple.formats.declaration import declared_table_format, table_names
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.storage import PLEStorage


def text_config_of(checkpoint: str | Path):
    cfg = AutoConfig.from_pretrained(checkpoint)
    return getattr(cfg, "text_config", None) or cfg


def load_ple_layer(
    checkpoint: str | Path, layer_id: int, storage: PLEStorage = PLEStorage(), dtype: torch.dtype = torch.bfloat16
) -> PLELayer:
    """The PLE layer of 1-indexed decoder layer `layer_id` (as in `ple_layer_ids`), stored as `storage` says.
    The table format is the checkpoint's, unless `storage.format` asks for BF16 <-> INT8 on the fly."""
    checkpoint = Path(checkpoint)
    cfg = text_config_of(checkpoint)
    index = next((i for i in ple_layers(cfg) if i.layer_id == layer_id), None)
    if index is None:
        raise ValueError(f"decoder layer {layer_id} has no PLE (ple_layer_ids={cfg.ple_layer_ids}).")
    raw = json.loads((checkpoint / "config.json").read_text())
    stored = declared_table_format(cfg, raw.get("quantization_config"), table_names(cfg))
    if storage.format is None:
        storage = dataclasses.replace(storage, format=stored)
    layer = PLELayer(cfg, index.ple, storage, dtype)
    # text-only (`model.layers.`) or multimodal, as the releases are (`model.language_model.layers.`)
    prefixes = [p + index.prefix.removeprefix("model.") for p in TEXT_PREFIXES]
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if prefix := next((p for p in prefixes if name.startswith(p)), None):
                    layer.load_weight(name[len(prefix) :], f.get_tensor(name), prefix)
    layer.finish_loading(index.prefix)
    return layer
