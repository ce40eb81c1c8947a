"""Checkpoint tensor names of the PLE layers (transformers' layout), in one place, and the one helper
for the three layer-index conventions: `layer_id` (1-based, as `ple_layer_ids` spells it), the 0-based
decoder index of `model.layers.{i}`, and the PLE index (position in the sorted `ple_layer_ids`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

TABLE = "ple_embedding.ngram_embedding"  # the table module; shards are `{TABLE}.shard_{j}.weight[_scale]`
SCALE_SUFFIX = "weight_scale"
SHARD = re.compile(r"ple_embedding\.ngram_embedding\.shard_(\d+)\.(weight|weight_scale|weight_scale_2)$")
# One scale for the whole table, as upstream vLLM reads FP8 (`weight_scale`) and NVFP4 (`weight_scale_2`) tables.
TABLE_SCALE = re.compile(r"ple_embedding\.ngram_embedding\.(weight_scale|weight_scale_2)$")
TABLE_SCALE_PART = {"fp8": "weight_scale", "nvfp4": "weight_scale_2"}  # by table format
HASH_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")  # under ple_embedding.
LAYER_PARAMS = ("key_proj.weight", "value_proj.weight", "norm_key.weight", "norm_query.weight",
                "norm_conv.weight", "conv1d.weight")  # fmt: skip
# Checkpoint tensors the text model deliberately does not load: the one list, each with its reason.
# (No official release carries the first three; upstream's loader skips them too.)
MIXER_INJECT = r"(^|\.)hyper_connection_mixer\.block_inject_weight\.weight$"
SKIPPED = {
    r"ple_embedding\.hashstats_\w+$": "PLE hash statistics (transformers keeps them non-persistent)",
    r"ple_embedding\.token_lookup$": "PLE token statistics (transformers keeps them non-persistent)",
    MIXER_INJECT: "the final mixer collapses the streams, injects nothing (transformers: use_combine=False)",
    r"^mtp\.": "the MTP head: the draft model (model.mtp.Qwen4ExpMTP) loads it when speculating",
}
# Skipped only when dense attention serves the attention layers (every sequence within the indexer budget).
SKIPPED_WITHOUT_QSA = {r"\.self_attn\.indexer\.": "the QSA indexer: dense attention is exact within its budget"}
UNUSED = re.compile("|".join(p for p in SKIPPED if "ple_embedding" in p))  # what PLE layers skip
# Matches the runtime table and its checkpoint shards, for compressed-tensors targets.
TABLE_TARGET = r"re:.*ple_embedding\.ngram_embedding.*"
TEXT_PREFIXES = ("model.", "model.language_model.")  # text-only and multimodal checkpoints


@dataclass(frozen=True)
class PLEIndex:
    ple: int  # position in sorted ple_layer_ids
    layer_id: int  # 1-based, as in ple_layer_ids
    decoder: int  # 0-based index of model.layers.{decoder}

    @property
    def prefix(self) -> str:
        """`model.layers.{decoder}.ple.`: where this layer's tensors live in a text-only checkpoint."""
        return f"model.layers.{self.decoder}.ple."


def ple_layers(text_config) -> list[PLEIndex]:
    return [PLEIndex(p, layer_id, layer_id - 1) for p, layer_id in enumerate(sorted(text_config.ple_layer_ids or []))]
