"""Quantization method for Qwen4Exp checkpoints whose PLE tables are INT8 rows, whatever quantizes the rest.

Such checkpoints (the HCU releases, or our quantizer's output) carry one compressed-tensors
`quantization_config`: a weight-only `int-quantized` group for the PLE tables (one bf16 scale per row) and,
optionally, groups for the main model (W8A8-INT8, W8A8-FP8, W4A16, ...). vLLM's compressed-tensors parser
reads the PLE group as W8A8 and rejects it. This method *is* vLLM's `CompressedTensorsConfig`, built from
the config minus the PLE groups: every main-model layer gets exactly the method vLLM gives it, and the PLE
layers read their INT8 shards themselves (`model.ple.PLEPlacement`). Claimed through vLLM's
`override_quantization_method` hook, for our architectures only.
"""

from typing import Any

from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

from qwen4_exp_hcu.env import our_architectures

NAME = "qwen4_exp_hcu_ple_int8"


def claims(hf_quant_cfg: dict[str, Any] | None, hf_config: Any) -> bool:
    """A compressed-tensors config, for our model class, with a PLE-table group in our INT8 row format."""
    from qwen4_exp_hcu.ple.int8_scheme import ple_group_names, ple_int8_scheme

    if not hf_quant_cfg or hf_quant_cfg.get("quant_method") != "compressed-tensors":
        return False
    if not our_architectures() & set(getattr(hf_config, "architectures", None) or []):
        return False
    return bool(ple_group_names(hf_quant_cfg)) and ple_int8_scheme(hf_quant_cfg)  # raises for other PLE schemes


@register_quantization_config(NAME)
class PLEInt8Config(CompressedTensorsConfig):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PLEInt8Config":
        from qwen4_exp_hcu.ple.int8_scheme import without_ple_groups

        return super().from_config(without_ple_groups(config))

    def get_name(self) -> str:
        return NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, NAME):
            return None
        return NAME if claims(hf_quant_cfg, hf_config) else None
