"""vLLM's config and our model built in the test process (world size 1, gloo), without an engine: what
`vllm serve` builds at startup, for tests that check start-up errors and weight loading case by case.
Needs the `vllm_process` fixture (conftest) active."""

import torch
from safetensors.torch import load_file


def engine_config(path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("max_model_len", 256)
    return EngineArgs(model=str(path), max_num_batched_tokens=64, max_num_seqs=4, **kwargs).create_engine_config()


def build_model(path, device="cpu", **kwargs):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = engine_config(path, **kwargs)
    default_dtype = torch.get_default_dtype()
    try:
        with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), torch.device(device):
            return initialize_model(vllm_config=config, model_config=config.model_config), config
    finally:  # vLLM caches rotary embeddings process-wide: keep these from a later in-process engine
        rotary_embedding._ROPE_DICT.clear()
        torch.set_default_dtype(default_dtype)  # vLLM 0.28's context leaves the model's when the build raises


def load(path, edit=None, device="cpu", **kwargs):
    """Build the model on `device` and load the checkpoint after `edit(weights)` changed it in memory."""
    from vllm.config import set_current_vllm_config

    model, config = build_model(path, device, **kwargs)
    weights = load_file(path / "model.safetensors")
    if edit is not None:
        edit(weights)
    with set_current_vllm_config(config):
        model.load_weights(iter(weights.items()))
    return model
