"""vLLM general plugin: serve Qwen4Exp checkpoints with this package's model class.

vLLM calls `register()` in every process it starts (API server, engine core, workers) through the
`vllm.general_plugins` entry point. The class is registered lazily (a `"module:Class"` string) so no
process imports torch-heavy model code, or touches an accelerator, before it needs the model.

It is registered under the architecture name `Qwen4ExpForCausalLM`, so real checkpoints and vLLM's
architecture-keyed settings (`--engram-config.*`, Qwen4Exp config checks) apply unchanged, and under the
explicit alias `Qwen4ExpHcuForCausalLM` (usable with `--hf-overrides '{"architectures": [...]}'`).
`QWEN4_EXP_HCU_DISABLE=1` keeps vLLM's own class; the alias is still ours (`qwen4_exp_hcu.env`).

It also registers a quantization method that claims checkpoints declaring INT8 PLE tables, whatever
quantizes their main model (see `qwen4_exp_hcu.model.quant`).
"""

from qwen4_exp_hcu.env import MODEL_CLASS, our_architectures


def register() -> None:
    from vllm import ModelRegistry

    for architecture in sorted(our_architectures()):
        ModelRegistry.register_model(architecture, MODEL_CLASS)
    # INT8-PLE checkpoints declare their tables in a way vLLM's own quantization parsers reject or ignore.
    import qwen4_exp_hcu.model.quant  # noqa: F401  (registers the quantization method)
