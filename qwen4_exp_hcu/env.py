"""The package's two environment variables and the architecture names it serves (a leaf module: the
vLLM plugin, the model and the quantization method all read it, none imports another for it)."""

import os

DISABLE_ENV = "QWEN4_EXP_HCU_DISABLE"
"""`1`: keep vLLM's own Qwen4Exp class (and its quantization handling); only the alias is ours."""
PREFETCH_ENV = "QWEN4_EXP_HCU_PREFETCH"
"""`0`: run each PLE lookup inside its layer instead of prefetching it on a side stream."""

ARCHITECTURE = "Qwen4ExpForCausalLM"  # what real checkpoints declare; vLLM keys --engram-config on it
ALIAS = "Qwen4ExpHcuForCausalLM"  # always ours, e.g. through --hf-overrides
MODEL_CLASS = "qwen4_exp_hcu.model.model:Qwen4ExpForCausalLM"

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def override_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def prefetch_enabled() -> bool:
    return os.environ.get(PREFETCH_ENV, "1").strip().lower() not in _FALSE


def our_architectures() -> set[str]:
    """The architecture names this package's class serves under the current environment."""
    return {ALIAS} if override_disabled() else {ALIAS, ARCHITECTURE}
