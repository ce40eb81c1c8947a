"""Qwen4Exp's MTP draft head (`mtp.*` in the checkpoint), served as vLLM's `Qwen4ExpMTP` draft model.

A draft step fuses the next token's embedding with the target's hyper-connection streams and runs one
(or `mtp_num_hidden_layers`) attention + MoE decoder layer without PLE:
`e = fc_embedding(norm_e(embed(token)))`, `s = fc_hidden(norm_h(streams))` per stream (`norm_h` spans all
`hc_count * hidden` features), the layer runs on `s + e` (e added to every stream), and the final
hyper-connection mixer collapses its output for the lm_head. It returns (collapsed `[T, hidden]` for the
logits, streams `[T, hc_count * hidden]` for the next draft step). The target hands the drafter its streams
before the final mixer (`Qwen4ExpForCausalLM.get_mtp_target_hidden_states`); vLLM's V2 model runner widens the
drafter's hidden buffers for that (`hc_mult`, set by vLLM's speculative config for `qwen4_exp_mtp`).
Embeddings and lm_head are the target's (vLLM shares them after loading).
"""

import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

from qwen4_exp_hcu.names import MIXER_INJECT
from qwen4_exp_hcu.norm import GroupedRMSNorm

from .hyper_connection import GatedResidual, inject
from .model import _STACKED, Qwen4ExpDecoderLayer, Qwen4ExpForCausalLM, qsa_builder, skip_unused_indexer

ATTENTION_LAYER_TYPE = "indexed_attention"  # the MTP layers' type (they have no GDN and no PLE)


class Qwen4ExpMultiTokenPredictor(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.hc_count, self.hidden_size = config.hc_count, config.hidden_size
        hidden, width, eps = config.hidden_size, config.hc_count * config.hidden_size, config.rms_norm_eps
        quant = vllm_config.quant_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, prefix=f"{prefix}.embed_tokens")
        self.pre_fc_norm_embedding = GroupedRMSNorm(hidden, hidden, eps)
        self.pre_fc_norm_hidden = GroupedRMSNorm(width, width, eps)
        self.fc_embedding, self.fc_hidden = (
            ColumnParallelLinear(hidden, hidden, bias=False, gather_output=True, return_bias=False,
                                 quant_config=quant, prefix=f"{prefix}.{name}")  # fmt: skip
            for name in ("fc_embedding", "fc_hidden")
        )
        first = config.num_hidden_layers  # the MTP layers continue the target's numbering (unique layer names)
        qsa = qsa_builder(vllm_config)
        self.use_qsa = qsa is not None
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(vllm_config, first + i, f"{prefix}.layers.{first + i}", qsa, ATTENTION_LAYER_TYPE)
            for i in range(getattr(config, "mtp_num_hidden_layers", 1))
        )
        self.hyper_connection_mixer = GatedResidual(config, prefix=f"{prefix}.hyper_connection_mixer", use_combine=False)

    def forward(self, input_ids, positions, hidden_states, spec_step_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        T = hidden_states.shape[0]
        embedded = self.fc_embedding(self.pre_fc_norm_embedding(self.embed_tokens(input_ids)))
        streams = self.fc_hidden(self.pre_fc_norm_hidden(hidden_states).view(T, self.hc_count, self.hidden_size))
        streams = (streams + embedded.unsqueeze(1)).flatten(1)
        streams, pending = self.layers[spec_step_idx % len(self.layers)](positions, streams, input_ids)
        streams = inject(streams, *pending)  # the next draft step reads the streams themselves
        return self.hyper_connection_mixer(streams), streams


class Qwen4ExpMTP(nn.Module):
    """vLLM's draft-model interface over `Qwen4ExpMultiTokenPredictor` (checkpoint `mtp.*` → `model.*`)."""

    packed_modules_mapping = Qwen4ExpForCausalLM.packed_modules_mapping

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = Qwen4ExpMultiTokenPredictor(vllm_config, prefix="mtp")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, hidden_states, intermediate_tensors=None, inputs_embeds=None,
                spec_step_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return self.model(input_ids, positions, hidden_states, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `mtp.*`, embeddings and lm_head; the target's own layers are not ours."""
        mapper = WeightsMapper(
            orig_to_new_regex={re.compile(MIXER_INJECT): None},
            orig_to_new_stacked=_STACKED,
            orig_to_new_prefix={"mtp.": "model.", "model.language_model.": "model."},
        ) | skip_unused_indexer(self.model.use_qsa)
        ours = ("mtp.", "model.embed_tokens.", "model.language_model.embed_tokens.", "lm_head.")
        return AutoWeightsLoader(self).load_weights(((n, t) for n, t in weights if n.startswith(ours)), mapper=mapper)
