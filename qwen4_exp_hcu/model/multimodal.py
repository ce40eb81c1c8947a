"""`Qwen4ExpForConditionalGeneration` for vLLM: vLLM's Qwen3-VL vision tower and processing + our text model.

The official checkpoints declare this architecture (transformers: a Qwen3-VL-style vision tower without
deepstack + the Qwen4Exp text model). Nothing of vision is re-implemented: the tower is vLLM's
`Qwen3_VisionTransformer`, prompts go through vLLM's Qwen3-VL processor (which expands each
`<|image_pad|>` to the image's token count), and M-RoPE positions are vLLM's Qwen3-VL positions, which equal
transformers' `get_rope_index` for images. Everything else is `Qwen4ExpForCausalLM`, including the PLE layers:
they hash the raw token ids with the image placeholders in them, as transformers does
(`requires_raw_input_tokens`). With `--language-model-only` vLLM builds no tower and no vision weights load.
"""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE, SupportsMultiModal, SupportsPP
from vllm.model_executor.models.qwen3_vl import (
    Qwen3_VisionTransformer,
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from vllm.model_executor.models.utils import StageMissingLayer, WeightsMapper
from vllm.multimodal import MULTIMODAL_REGISTRY

from .model import Qwen4ExpForCausalLM, _join


class Qwen4ExpProcessingInfo(Qwen3VLProcessingInfo):
    def get_hf_config(self):
        return self.ctx.get_hf_config()  # transformers' Qwen4ExpConfig, not a Qwen3VLConfig


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor, info=Qwen4ExpProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class Qwen4ExpForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsMRoPE, HasInnerState, IsHybrid, SupportsPP):
    requires_raw_input_tokens = True  # PLE hashes token ids, image placeholders included
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={
            "model.visual.": "visual.",
            "model.language_model.": "language_model.model.",
            "lm_head.": "language_model.lm_head.",
            "mtp.": "language_model.mtp.",  # the text model skips it (`names.SKIPPED`): the MTP draft model's
        }
    )
    packed_modules_mapping = Qwen4ExpForCausalLM.packed_modules_mapping | {"qkv": ["qkv"]}  # the tower's fused qkv

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return Qwen3VLForConditionalGeneration.get_placeholder_str(modality, i)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config = vllm_config.model_config.hf_config
        with self._mark_tower_model(vllm_config, {"image", "video"}):  # not built with --language-model-only
            self.visual = Qwen3_VisionTransformer(
                config.vision_config, quant_config=vllm_config.quant_config, prefix=_join(prefix, "visual")
            )
        with self._mark_language_model(vllm_config):
            self.language_model = Qwen4ExpForCausalLM(vllm_config=vllm_config, prefix=_join(prefix, "language_model"))
        self.make_empty_intermediate_tensors = self.language_model.make_empty_intermediate_tensors

    def embed_multimodal(self, **kwargs: object) -> tuple[torch.Tensor, ...]:
        """One embedding tensor per image or video, in the order vLLM passes them."""
        embeddings = []
        for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if kwargs.get(pixels) is None:
                continue
            grid_thw = kwargs[grid]
            merged = self.visual(kwargs[pixels].type(self.visual.dtype), grid_thw=grid_thw)
            sizes = (grid_thw.prod(-1) // self.visual.spatial_merge_size**2).tolist()
            embeddings.extend(merged.split(sizes))
        return tuple(embeddings)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        return Qwen3VLForConditionalGeneration._get_mrope_input_positions(input_tokens, mm_features, self.config)

    def get_mtp_target_hidden_states(self) -> torch.Tensor | None:
        return self.language_model.get_mtp_target_hidden_states()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.language_model.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """One pass over the checkpoint, in whatever order its files hold the tensors: vision tensors go to
        the tower as they come (skipped without one), the text model's stream into one `load_weights` call,
        which checks its PLE tables complete once, at the end."""
        loaded: set[str] = set()
        tower = not isinstance(self.visual, StageMissingLayer)

        def text_weights():
            for name, tensor in self.hf_to_vllm_mapper.apply(weights):
                part, _, rest = name.partition(".")
                if part == "language_model":
                    yield rest, tensor
                elif tower:
                    loaded.update(f"visual.{n}" for n in self.visual.load_weights([(rest, tensor)]))

        loaded.update(f"language_model.{n}" for n in self.language_model.load_weights(text_weights()))
        return loaded

    # The state layouts are the text model's.
    get_mamba_state_dtype_from_config = Qwen4ExpForCausalLM.get_mamba_state_dtype_from_config
    get_mamba_state_shape_from_config = Qwen4ExpForCausalLM.get_mamba_state_shape_from_config
    get_mamba_state_copy_func = Qwen4ExpForCausalLM.get_mamba_state_copy_func
    get_mamba_state_copy_funcs = Qwen4ExpForCausalLM.get_mamba_state_copy_funcs
    get_mamba_specs_from_config = Qwen4ExpForCausalLM.get_mamba_specs_from_config
