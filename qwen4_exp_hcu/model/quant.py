"""Quantization method for checkpoints whose only quantized tensors are INT8 PLE tables.

The quantizer writes a compressed-tensors `int-quantized` group (weights only, one bf16 scale per row)
that targets nothing but the PLE tables. vLLM's own compressed-tensors parser reads `int-quantized` as
W8A8 and asserts on it before any model code runs, so the plugin registers this method, which claims such
checkpoints through vLLM's `override_quantization_method` hook (only for our architectures). Every vLLM
layer stays unquantized; the PLE layer reads its INT8 shards and scales itself.
"""

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from qwen4_exp_hcu.env import our_architectures

NAME = "qwen4_exp_hcu_ple_int8"


def claims(hf_quant_cfg: dict[str, Any] | None, hf_config: Any) -> bool:
    """A compressed-tensors config, for our model class, whose groups all target PLE tables only."""
    if not hf_quant_cfg or hf_quant_cfg.get("quant_method") != "compressed-tensors":
        return False
    if not our_architectures() & set(getattr(hf_config, "architectures", None) or []):
        return False
    groups = hf_quant_cfg.get("config_groups") or {}
    targets = [t for g in groups.values() for t in (g.get("targets") or [])]
    if not targets or not all("ngram_embedding" in t for t in targets):
        return False
    from qwen4_exp_hcu.ple.int8_scheme import ple_int8_scheme

    return ple_int8_scheme(hf_quant_cfg)  # raises ValueError, naming the group, for any other scheme


@register_quantization_config(NAME)
class PLEInt8Config(QuantizationConfig):
    def __init__(self, checkpoint_config: dict[str, Any]) -> None:
        super().__init__()
        self.checkpoint_config = checkpoint_config

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PLEInt8Config":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, NAME):
            return None
        return NAME if claims(hf_quant_cfg, hf_config) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None
