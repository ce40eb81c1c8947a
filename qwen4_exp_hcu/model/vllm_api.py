"""The vLLM interfaces that differ between the releases this package serves on, one function for each
difference, named after what differs. The model code calls these and never asks which release it runs on;
each function finds out by the interface itself (a parameter, an attribute, a module), so a release that changes
one of them breaks one function here. `tests/test_vllm_releases.py` loads checkpoints through every supported
release on the CPU, and `make test-releases` runs the suite on the oldest."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.attention.backends import short_conv_attn
from vllm.v1.kv_cache_interface import MambaSpec

from qwen4_exp_hcu.env import override_disabled

QWEN4_EXP_PACKAGE = "vllm.models.qwen4_exp"


def has_qwen4_exp() -> bool:
    """Whether vLLM has its own Qwen4Exp code (its classes, QSA kernels, config hooks)."""
    return importlib.util.find_spec(QWEN4_EXP_PACKAGE) is not None


def vllm_classes_kept() -> bool:
    """`QWEN4_EXP_HCU_DISABLE=1` where vLLM has Qwen4Exp classes of its own to keep; where it has none, ours
    serve anyway."""
    return override_disabled() and has_qwen4_exp()


def qsa_attention_builder(vllm_config: VllmConfig) -> Callable[[int, str], nn.Module]:
    """`build(layer_id, prefix)`: vLLM's own Qwen4Exp QSA attention for this platform (imported, never copied).
    Where that class takes a top-k index buffer shared by all its layers, the builder allocates one (sized by
    vLLM's own helper) and hands it to every layer it builds: call it once per model."""
    from vllm.platforms import current_platform

    config = vllm_config.model_config.hf_text_config
    if not has_qwen4_exp():
        raise ValueError(
            f"Qwen4Exp attention beyond the QSA budget needs vLLM's own QSA kernels, which this vLLM release does "
            f"not have: --max-model-len={vllm_config.model_config.max_model_len} > "
            f"indexer_budget={config.indexer_budget}. Set --max-model-len <= {config.indexer_budget}."
        )
    package = f"{QWEN4_EXP_PACKAGE}.{'amd' if current_platform.is_rocm() else 'nvidia'}"
    # `qsa` and `model` import each other; entering through `model` resolves the cycle.
    model = importlib.import_module(f"{package}.model")
    cls = importlib.import_module(f"{package}.qsa").Qwen4ExpQSAAttention
    shared = {}
    if "topk_indices_buffer" in inspect.signature(cls).parameters:
        width = model.get_qsa_topk_buffer_width(config)
        rows = vllm_config.scheduler_config.max_num_batched_tokens
        shared["topk_indices_buffer"] = torch.empty(rows, width, dtype=torch.int32)

    def build(layer_id: int, prefix: str) -> nn.Module:
        return cls(vllm_config=vllm_config, config=config, layer_id=layer_id, quant_config=vllm_config.quant_config,
                   prefix=prefix, **shared)  # fmt: skip

    return build


def drafter_gets_target_streams(vllm_config: VllmConfig) -> bool:
    """Whether vLLM hands an MTP drafter the target's `get_mtp_target_hidden_states` (all hyper-connection
    streams): its V2 model runner does, the V1 runner does not. Releases that only have the V2 runner have
    no switch for it."""
    return getattr(vllm_config, "use_v2_model_runner", True)


def disk_offload_requested(vllm_config: VllmConfig) -> bool:
    """`--engram-config.disk_offload` (upstream's own disk tier, in the releases that have it)."""
    engram = getattr(vllm_config, "engram_config", None)
    return bool(getattr(engram, "disk_offload", False))


def etp_group():
    """The group a PLE table's rows are split over: vLLM's ETP group (TP, or TP x DP with
    `--engram-config.embedding_across_dp`) where the release builds one, else its TP group."""
    import vllm.distributed as distributed

    get_etp_group = getattr(distributed, "get_etp_group", None)
    return get_etp_group() if get_etp_group is not None else distributed.get_tp_group()


def mamba_spec(**fields: Any) -> MambaSpec:
    """vLLM's `MambaSpec` with the fields this release has: `tp_replicated` (a state every TP rank holds whole)
    is newer than the spec itself; without it each rank simply keeps its own copy."""
    known = {f.name for f in dataclasses.fields(MambaSpec)}
    return MambaSpec(**{name: value for name, value in fields.items() if name in known})


def state_copies_per_type() -> bool:
    """Whether vLLM asks a hybrid model for state copy functions per state type, which prefix caching of the PLE
    state beside the GDN state needs; releases before that copy every state with one set."""
    from vllm.model_executor.models.interfaces import IsHybrid

    return hasattr(IsHybrid, "get_mamba_state_copy_funcs")


def ple_attention_backend() -> type:
    """vLLM's PLE short-conv backend, or where the release has only the plain short-conv one, `PLEShortConvBackend`."""
    return getattr(short_conv_attn, "PleShortConvAttentionBackend", PLEShortConvBackend)


@dataclasses.dataclass
class PLEShortConvMetadata(short_conv_attn.ShortConvAttentionMetadata):
    """The plain short-conv metadata plus what `ple_step.pack` reads that it lacks. No speculative fields:
    releases without vLLM's PLE backend are served without speculative decoding."""

    query_start_loc: torch.Tensor | None = None
    num_spec_decodes: int = 0
    spec_sequence_masks: torch.Tensor | None = None


class PLEShortConvMetadataBuilder(short_conv_attn.ShortConvAttentionMetadataBuilder):
    metadata_cls = PLEShortConvMetadata

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, **kwargs) -> PLEShortConvMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build, **kwargs)
        return dataclasses.replace(metadata, query_start_loc=common_attn_metadata.query_start_loc)


class PLEShortConvBackend(short_conv_attn.ShortConvAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "QWEN4_EXP_HCU_PLE_SHORT_CONV"

    @staticmethod
    def get_builder_cls() -> type[PLEShortConvMetadataBuilder]:
        return PLEShortConvMetadataBuilder
