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
quantizes their main model (see `qwen4_exp_hcu.model.quant`), and parses the plugin's settings
(`qwen4_exp_hcu.settings`) as soon as vLLM has a config to check them in, and, when an engine process fails,
repeats the root cause as the last line (`qwen4_exp_hcu.startup_report`).
"""

import contextlib
import logging
import os

from qwen4_exp_hcu.env import DISABLE_ENV, TORCH_OPS_ENV, graph_environment, our_architectures, override_disabled
from qwen4_exp_hcu.settings import engine_settings
from qwen4_exp_hcu.startup_report import new_engine_start, watch_engine_process

logger = logging.getLogger("vllm.qwen4_exp_hcu")


def register() -> None:
    from vllm import ModelRegistry

    from qwen4_exp_hcu.kernels import torch_ops
    from qwen4_exp_hcu.model.vllm_api import vllm_classes_kept
    from qwen4_exp_hcu.kernels.down_silu import configured_launch

    watch_engine_process()
    torch_ops()  # an unknown kernel name in QWEN4_EXP_HCU_TORCH_OPS stops here, before any engine starts
    configured_launch()  # as an unknown launch in QWEN4_EXP_HCU_DOWN_SILU
    if override_disabled() and not vllm_classes_kept():
        logger.warning("%s=1 keeps vLLM's own Qwen4Exp classes, but this vLLM release has none: qwen4_exp_hcu's "
                       "serve Qwen4Exp checkpoints.", DISABLE_ENV)  # fmt: skip
    for architecture, model_class in sorted(our_architectures(vllm_classes_kept()).items()):
        ModelRegistry.register_model(architecture, model_class)
        check_settings_with_config(architecture)
    # INT8-PLE checkpoints declare their tables in a way vLLM's own quantization parsers reject or ignore.
    import qwen4_exp_hcu.model.quant  # noqa: F401  (registers the quantization method)


def check_settings_with_config(architecture: str) -> None:
    """Parse and check the plugin settings where vLLM checks a model's config: `MODELS_CONFIG_MAP[architecture]
    .verify_and_update_config(vllm_config)`, which `VllmConfig` runs while it is built (in the process that
    parses the arguments, before any engine process starts or loads weights; `additional_config` is the
    earliest thing there that holds them); the config keeps them for the model (`settings.engine_settings`).
    vLLM has no public hook for this: the entry is vLLM's own hook for the architecture, if any, subclassed and
    still run first. The same moment names the engine's report file."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    base = MODELS_CONFIG_MAP.get(architecture, VerifyAndUpdateConfig)
    if getattr(base, "checks_plugin_settings", False):  # register() ran before in this process
        return

    class WithPluginSettings(base):
        checks_plugin_settings = True

        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            from vllm.platforms import current_platform

            with single_stage_view(vllm_config.parallel_config):
                base.verify_and_update_config(vllm_config)
            engine_settings(vllm_config)  # parsed once, here: bad settings fail naming them
            check_engram(vllm_config)
            check_prefix_caching(vllm_config)
            gdn_state_in_fp32_on_cpu(vllm_config, current_platform.is_cpu())
            check_torch_ops(vllm_config.model_config.enforce_eager, current_platform.is_cuda_alike())
            key_compiled_graphs_by_environment(vllm_config)
            new_engine_start()

    MODELS_CONFIG_MAP[architecture] = WithPluginSettings


@contextlib.contextmanager
def single_stage_view(parallel_config):
    """`parallel_config` as one pipeline stage while vLLM's own hook for the architecture runs: releases before
    0.34 refuse pipeline parallelism there because vLLM's class hashes token ids on the first stage only; ours
    hands them to every stage (`model.model.Qwen4ExpModel`). Its other checks still run."""
    stages = parallel_config.pipeline_parallel_size
    parallel_config.pipeline_parallel_size = 1
    try:
        yield
    finally:
        parallel_config.pipeline_parallel_size = stages


def check_prefix_caching(vllm_config) -> None:
    """Prefix caching off (said in the log) where vLLM copies every state of a hybrid model with one set of
    functions: cached PLE states need their own. Turned off here, before vLLM sizes its cache blocks for it."""
    from qwen4_exp_hcu.model.vllm_api import state_copies_per_type

    cache, config = vllm_config.cache_config, vllm_config.model_config.hf_text_config
    if cache.enable_prefix_caching and getattr(config, "ple_layer_ids", None) and not state_copies_per_type():
        logger.warning("Prefix caching is off: this vLLM release copies every cached state of a hybrid model with "
                       "one set of functions, and the PLE state needs its own.")  # fmt: skip
        cache.enable_prefix_caching = False


def gdn_state_in_fp32_on_cpu(vllm_config, cpu: bool) -> None:
    """vLLM's CPU GDN kernels keep their recurrent state in fp32 (`chunk_gated_delta_rule_cpu` refuses another
    dtype); releases before 0.32 set that only on CPUs with AMX."""
    if cpu and vllm_config.cache_config.mamba_ssm_cache_dtype == "auto":
        vllm_config.cache_config.mamba_ssm_cache_dtype = "float32"


def check_engram(vllm_config) -> None:
    """Engram settings this package serves its own way, refused at start-up with what to use instead."""
    from qwen4_exp_hcu.model.vllm_api import disk_offload_requested
    from qwen4_exp_hcu.settings import WHERE

    if disk_offload_requested(vllm_config):
        raise ValueError(
            "--engram-config.disk_offload is vLLM's own disk tier for its Qwen4Exp class. qwen4_exp_hcu reads PLE rows "
            f"from the checkpoint's files through its file tier instead: drop disk_offload and set {WHERE}.host_table_gib "
            "(GiB per rank of the most-read rows kept in host memory; the rest are read from the files), e.g. "
            '--additional-config \'{"qwen4_exp_hcu": {"host_table_gib": 4}}\'.'
        )


ENVIRONMENT_KEY = "qwen4_exp_hcu_environment"


def key_compiled_graphs_by_environment(vllm_config) -> None:
    """The environment settings the model's traced forward reads (`env.GRAPH_ENVS`), copied into
    `additional_config`: vLLM keys its torch.compile cache by the config, `additional_config` included, and by its
    own `VLLM_*` variables alone, so without them a graph compiled with the prefetch on would be loaded with it off
    (vLLM 0.34's AOT cache checks the traced files, which the setting does not change)."""
    if isinstance(vllm_config.additional_config, dict):  # not a `SupportsCompileFactors`, which hashes itself
        vllm_config.additional_config[ENVIRONMENT_KEY] = graph_environment()


def check_torch_ops(enforce_eager: bool, accelerator: bool) -> None:
    """Torch references in place of kernels (`QWEN4_EXP_HCU_TORCH_OPS`) only without CUDA graphs: some read
    values back to the host (boolean indexing), which a graph capture refuses mid-capture (not `CAPTURABLE`'s)."""
    from qwen4_exp_hcu.kernels import CAPTURABLE, torch_ops

    if accelerator and (torch_ops() - CAPTURABLE) and not enforce_eager:
        raise ValueError(f"{TORCH_OPS_ENV}={os.environ[TORCH_OPS_ENV]!r} swaps kernels for torch references, some of "
                         "which sync with the host: CUDA graphs cannot capture them. Add --enforce-eager.")  # fmt: skip
