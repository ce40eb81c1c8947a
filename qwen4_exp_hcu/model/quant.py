"""Quantization entry point for Qwen4Exp checkpoints whose PLE tables are INT8 rows, whatever quantizes the rest.

Such checkpoints declare the tables in their `quantization_config`: a weight-only compressed-tensors
`int-quantized` group (the HCU layout, beside the main model's groups), or, when the main model uses
another method (`quant_method: fp8`, ModelOpt, ...), a compressed-tensors config under `ple_tables` next to it.
* **compressed-tensors:** vLLM's parser reads the PLE group as W8A8 and rejects it. So this method claims those
  checkpoints (for our architectures only, through vLLM's `override_quantization_method` hook) and hands
  vLLM **the main model's own compressed-tensors config** without the PLE group.
* **Any other method:** vLLM's own method takes the checkpoint. Its parser ignores the `ple_tables` entry,
  and vLLM's own method resolution applies (e.g. ModelOpt `NVFP4` → `modelopt_fp4`).

Either way every main-model layer gets exactly the method and kernels vLLM gives its scheme, and the PLE
layers read their INT8 shards themselves (`model.ple_placement.ple_table_format`). No scheme is re-implemented here.
"""

from typing import Any

import torch
from vllm.model_executor.layers.quantization import get_quantization_config, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.platforms import current_platform

from qwen4_exp_hcu.env import our_architectures

from .vllm_api import vllm_classes_kept

NAME = "qwen4_exp_hcu_ple_int8"


def claims(hf_quant_cfg: dict[str, Any] | None, hf_config: Any) -> bool:
    """A compressed-tensors checkpoint of our model class with a group of INT8 PLE tables (raises for
    another PLE scheme, whatever the main method)."""
    from qwen4_exp_hcu.ple.formats.int8_scheme import declares_int8_tables

    if not our_architectures(vllm_classes_kept()).keys() & set(getattr(hf_config, "architectures", None) or []):
        return False
    return declares_int8_tables(hf_quant_cfg) and hf_quant_cfg.get("quant_method") == "compressed-tensors"


@register_quantization_config(NAME)
class PLEInt8Config(QuantizationConfig):
    """Never instantiated: `from_config` returns the main model's compressed-tensors config, vLLM's own class."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        from qwen4_exp_hcu.ple.formats.int8_scheme import main_model_config

        main = main_model_config(config)
        return get_quantization_config(main["quant_method"]).from_config(main)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, NAME):
            return None
        return NAME if claims(hf_quant_cfg, hf_config) else None

    # QuantizationConfig's interface; vLLM asks the instance `from_config` returns, never this class.
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

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        raise NotImplementedError("PLEInt8Config.from_config returns the main model's own config.")


def accept_on(platform: type) -> None:
    """Make `platform` (a vLLM platform class) accept this method where it lists the methods it accepts (ROCm and
    Hygon's HCU do; an empty list accepts any): the name only routes the checkpoint to the main model's own
    config, which the platform then checks like any other, and the PLE tables are read by this package's kernels."""
    if platform.supported_quantization and NAME not in platform.supported_quantization:
        platform.supported_quantization = [*platform.supported_quantization, NAME]


accept_on(type(current_platform))
