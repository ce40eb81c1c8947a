"""vLLM general plugin: serve Qwen4Exp checkpoints with this package's model class.

vLLM calls `register()` in every process it starts (API server, engine core, workers) through the
`vllm.general_plugins` entry point. The class is registered lazily (a `"module:Class"` string) so no
process imports torch-heavy model code, or touches an accelerator, before it needs the model.

The classes are registered under the architecture names real checkpoints declare, `Qwen4ExpForCausalLM` and
`Qwen4ExpForConditionalGeneration` (vision tower + text model), so vLLM's architecture-keyed settings
(`--engram-config.*`, Qwen4Exp config checks) apply unchanged, and the text class under the explicit alias
`Qwen4ExpHcuForCausalLM` (usable with `--hf-overrides '{"architectures": [...]}'`). `QWEN4_EXP_HCU_DISABLE=1`
keeps vLLM's own classes; the alias is still ours (`qwen4_exp_hcu.env`).

It also registers a quantization method that claims checkpoints declaring INT8 PLE tables, whatever
quantizes their main model (see `qwen4_exp_hcu.model.quant`).
"""

from qwen4_exp_hcu.env import our_architectures


def register() -> None:
    from vllm import ModelRegistry

    for architecture, model_class in sorted(our_architectures().items()):
        ModelRegistry.register_model(architecture, model_class)
    # INT8-PLE checkpoints declare their tables in a way vLLM's own quantization parsers reject or ignore.
    import qwen4_exp_hcu.model.quant  # noqa: F401  (registers the quantization method)
