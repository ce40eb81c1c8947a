"""vLLM general plugin: serve Qwen4Exp checkpoints with this package's model class.

vLLM calls `register()` in every process it starts (API server, engine core, workers) through the
`vllm.general_plugins` entry point. The class is registered lazily (a `"module:Class"` string) so no
process imports torch-heavy model code, or touches an accelerator, before it needs the model.

It is registered under the architecture name `Qwen4ExpForCausalLM`, so real checkpoints and vLLM's
architecture-keyed settings (`--engram-config.*`, Qwen4Exp config checks) apply unchanged, and under the
explicit alias `Qwen4ExpHcuForCausalLM` (usable with `--hf-overrides '{"architectures": [...]}'`).

It also registers a quantization method that claims checkpoints whose only quantized tensors are the
INT8 PLE tables (see `qwen4_exp_hcu.model.quant`).

Set `QWEN4_EXP_HCU_DISABLE=1` to keep vLLM's own `Qwen4ExpForCausalLM` (and its quantization handling);
the alias is still registered.
"""

import os

DISABLE_ENV = "QWEN4_EXP_HCU_DISABLE"
MODEL_CLASS = "qwen4_exp_hcu.model.model:Qwen4ExpForCausalLM"
ARCHITECTURE = "Qwen4ExpForCausalLM"
ALIAS = "Qwen4ExpHcuForCausalLM"


def override_disabled() -> bool:
    """Whether `QWEN4_EXP_HCU_DISABLE` asks to keep vLLM's own Qwen4Exp class."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def register() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ALIAS, MODEL_CLASS)
    if not override_disabled():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    # INT8-PLE checkpoints carry a quantization config vLLM's compressed-tensors parser rejects.
    import qwen4_exp_hcu.model.quant  # noqa: F401  (registers the quantization method)
