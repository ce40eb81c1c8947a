"""The vLLM interfaces that differ between the releases this package serves on, one function for each
difference, named after what differs. The model code calls these and never asks which release it runs on;
each function finds out by the interface itself (a parameter, an attribute), so a release that changes one of
them breaks one function here, which `tests/test_vllm_releases.py` runs against every supported release."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable

import torch
from torch import nn
from vllm.config import VllmConfig

BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"


def qsa_attention_builder(vllm_config: VllmConfig) -> Callable[[int, str], nn.Module]:
    """`build(layer_id, prefix)`: vLLM's own Qwen4Exp QSA attention for this platform (imported, never copied).
    Where that class takes a top-k index buffer shared by all its layers, the builder allocates one (sized by
    vLLM's own helper) and hands it to every layer it builds: call it once per model."""
    from vllm.platforms import current_platform

    package = f"vllm.models.qwen4_exp.{'amd' if current_platform.is_rocm() else 'nvidia'}"
    # `qsa` and `model` import each other; entering through `model` resolves the cycle.
    model = importlib.import_module(f"{package}.model")
    cls = importlib.import_module(f"{package}.qsa").Qwen4ExpQSAAttention
    config = vllm_config.model_config.hf_text_config
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


def breakable_cudagraphs(vllm_config: VllmConfig) -> bool:
    """Whether the engine built from `vllm_config` runs breakable CUDA graphs: resolved into the compilation
    config where vLLM keeps it there, otherwise set in the environment while the config is built."""
    resolved = getattr(vllm_config.compilation_config, "use_breakable_cudagraph", None)
    return resolved if resolved is not None else os.environ.get(BREAKABLE_ENV) == "1"
