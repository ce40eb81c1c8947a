"""Where the PLE tables live, read once per model from vLLM's config: `EngramConfig`, the platform, the checkpoint's
table declaration and the plugin settings become one `PLEStorage` (shared by every PLE layer of this rank), the
hot-row cache settings and the prefetch workspace."""

from __future__ import annotations

import dataclasses
import os

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger

from qwen4_exp_hcu.env import prefetch_enabled
from qwen4_exp_hcu.names import ple_layers
from qwen4_exp_hcu.ple.formats.rows import check_hot_rows
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.settings import ENGRAM, WHERE, engine_settings

from .vllm_api import etp_group

logger = init_logger(__name__)


class PLEPlacement:
    """Where the PLE tables live and how they are sharded (`storage`), the hot-row cache's (bytes per layer,
    calibration tokens) (`hot_rows`), and the prefetch workspace every PLE block takes its handle from
    (`prefetch`, None with `QWEN4_EXP_HCU_PREFETCH=0`)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        from vllm.distributed import get_tp_group
        from vllm.platforms import current_platform
        from vllm.utils.platform_utils import is_uva_available

        from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace

        engram = engram_settings(vllm_config)
        cpu_offload = engram.cpu_offload
        dp = vllm_config.parallel_config.data_parallel_size
        across_dp = engram.embedding_across_dp and dp > 1
        device = torch.device(vllm_config.device_config.device)
        check_uva(cpu_offload, device, is_uva_available(), current_platform.device_name)
        etp = etp_group()
        storage = PLEStorage(
            format=ple_table_format(vllm_config), device=device, host=cpu_offload,
            etp_group=etp if etp.world_size > 1 else None, across_dp=across_dp,
            replica_group=get_tp_group() if across_dp else None,  # the TP ranks of this DP replica: same tokens
        )  # fmt: skip
        # DP replicas hold the same TP-sharded tables: with dp_shared_memory, one host copy per node
        share = engram.dp_shared_memory and dp > 1 and cpu_offload and not across_dp
        shared = dp_shared_host(vllm_config, storage) if share else None
        # 2 MiB host pages (vLLM accepts use_thp only with cpu_offload and without dp_shared_memory)
        huge_pages = engram.use_thp and cpu_offload and shared is None
        placed = dataclasses.replace(storage, shared=shared, huge_pages=huge_pages)
        file_tier, self.file_calibration = file_tier_settings(vllm_config, placed)
        self.storage = dataclasses.replace(placed, file_tier=file_tier)
        self.hot_rows = hot_rows_settings(vllm_config, self.storage)
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.prefetch = PrefetchWorkspace([], max_tokens, device) if prefetch_enabled() else None


@dataclasses.dataclass(frozen=True)
class EngramSettings:
    cpu_offload: bool = True  # vLLM's default for Qwen4Exp; also for the alias architecture, which gets no config
    embedding_across_dp: bool = False
    dp_shared_memory: bool = False
    use_thp: bool = False


def engram_settings(vllm_config: VllmConfig) -> EngramSettings:
    """`--engram-config` where the release parses it, overridden by the plugin's settings of the same names,
    which every release accepts. `embedding_across_dp` comes from vLLM's only: vLLM sizes its ETP group by it."""
    engram = getattr(vllm_config, "engram_config", None)
    values = {f.name: bool(getattr(engram, f.name, f.default)) for f in dataclasses.fields(EngramSettings)}
    values.update(engine_settings(vllm_config).model_dump(include=set(ENGRAM), exclude_none=True))
    return EngramSettings(**values)


def hot_rows_settings(vllm_config: VllmConfig, storage: PLEStorage):
    """(accelerator bytes per PLE layer, calibration tokens or None) of the opt-in hot-row cache, from the plugin
    settings (`qwen4_exp_hcu.settings`, whose names and types vLLM's config hook already checked); here what
    needs the storage and the calibration file."""
    from qwen4_exp_hcu.ple.tiers.hot_rows import load_calibration_tokens

    settings = engine_settings(vllm_config)
    gib, calibration = settings.hot_rows_gib, settings.hot_rows_calibration
    if not gib:
        return 0, None
    device = torch.device(storage.device)
    if not storage.host or device.type == "cpu":
        raise ValueError(
            f"{WHERE}.hot_rows_gib caches host-resident PLE rows in accelerator memory: it needs "
            f"--engram-config.cpu_offload=True on an accelerator (here: cpu_offload={storage.host}, device {device})."
        )
    check_hot_rows(storage.format, f"{WHERE}.hot_rows_gib: ")
    config = vllm_config.model_config.hf_text_config
    tokens = None if calibration is None else load_calibration_tokens(calibration, config.vocab_size)
    return int(gib * 2**30) // len(ple_layers(config)), tokens


def file_tier_settings(vllm_config: VllmConfig, storage: PLEStorage):
    """(`FileTier` or None, its calibration tokens or None) from `host_table_gib`: the checkpoint's files, and the
    host bytes of each PLE layer's resident rows."""
    from qwen4_exp_hcu.ple.etp import looked_up_tokens
    from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
    from qwen4_exp_hcu.ple.tiers.file_rows import FileTier, excluded_settings
    from qwen4_exp_hcu.ple.hashing import ngram_heads
    from qwen4_exp_hcu.ple.tiers.hot_rows import load_calibration_tokens

    settings = engine_settings(vllm_config)
    if not settings.host_table_gib:
        return None, None
    if not storage.host:
        raise ValueError(f"{WHERE}.host_table_gib keeps part of host-resident PLE tables in files: it needs --engram-config.cpu_offload=True.")
    if excluded := excluded_settings(storage):
        raise ValueError(f"{WHERE}.host_table_gib does not combine with {', '.join(excluded)} (--engram-config.dp_shared_memory, use_thp).")
    config = vllm_config.model_config.hf_text_config
    files = CheckpointFiles(checkpoint_directory(vllm_config))
    # staging for every id the largest step looks up (tokens x n-gram heads), so it never grows (and re-pins) while
    # serving: CUDA graphs hold its address.
    world = storage.etp_group.world_size if storage.etp_group is not None else 1
    tp = storage.replica_group.world_size if storage.replica_group is not None else 1
    tokens = looked_up_tokens(world, storage.across_dp, vllm_config.scheduler_config.max_num_batched_tokens, tp)
    most_ids = tokens * ngram_heads(config)
    calibration = settings.host_table_calibration
    # calibrated resident rows stay put: no counts, no promotions (refresh_every 0); otherwise they follow traffic
    tier = FileTier(files, int(settings.host_table_gib * 2**30) // len(ple_layers(config)), staging_rows=most_ids,
                    **({"refresh_every": 0} if calibration else {}))  # fmt: skip
    return tier, None if calibration is None else load_calibration_tokens(calibration, config.vocab_size)


def checkpoint_directory(vllm_config: VllmConfig) -> str:
    """The local directory of the served checkpoint: the model path, or its Hugging Face snapshot in the cache vLLM
    downloaded it to (`--download-dir`, else the default cache), so the rows come from the files vLLM loaded."""
    model = vllm_config.model_config.model
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = vllm_config.load_config.download_dir
    try:
        return snapshot_download(model, revision=vllm_config.model_config.revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError as e:  # it names neither the setting nor the cache
        raise ValueError(f"{WHERE}.host_table_gib reads PLE rows from {model}'s files, but no local snapshot of it is in "
                         f"{cache or 'the default Hugging Face cache'}: {e}") from e  # fmt: skip


def check_uva(cpu_offload: bool, device: torch.device, uva_available: bool, platform: str) -> None:
    """Host-resident tables are read by accelerator kernels over UVA; without it, fail before loading."""
    if cpu_offload and device.type != "cpu" and not uva_available:
        raise ValueError(
            f"--engram-config.cpu_offload=True keeps the PLE tables in pinned host memory, read over UVA, "
            f"but UVA (pinned memory) is not available on {platform}. Pass --engram-config.cpu_offload=False "
            "to keep the tables in accelerator memory."
        )


def dp_shared_host(vllm_config: VllmConfig, storage: PLEStorage):
    """The DP group's shared host memory, or None (with a warning) when /dev/shm cannot hold the tables this
    rank owns under `storage`; the group's first rank decides for all and names the run."""
    import secrets
    import shutil

    from vllm.distributed import get_dp_group

    from qwen4_exp_hcu.ple.etp import ETPLookup
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec
    from qwen4_exp_hcu.ple.tiers.host_memory import SHM_DIR, SharedHost

    config = vllm_config.model_config.hf_text_config
    sizing = dataclasses.replace(storage, device="meta", host=False)
    specs = [NgramHashSpec.from_config(config, index.ple) for index in ple_layers(config)]
    need = sum(ETPLookup(s.rows, s.head_dim, sizing).table.nbytes for s in specs)
    group = get_dp_group()
    if group.rank_in_group == 0:
        free = shutil.disk_usage(SHM_DIR).free if os.path.isdir(SHM_DIR) else 0
        decision = (f"qwen4hcu-{os.getpid()}-{secrets.token_hex(4)}", free, free >= need)
    run, free, fits = group.broadcast_object(decision if group.rank_in_group == 0 else None, src=0)
    if not fits:
        logger.warning(
            "--engram-config.dp_shared_memory: %s has %.2f GiB free, the PLE tables of a rank take %.2f GiB; "
            "each DP replica keeps its own copy.", SHM_DIR, free / 2**30, need / 2**30,
        )  # fmt: skip
        return None
    return SharedHost(group, run)


def ple_table_format(vllm_config: VllmConfig) -> str:
    """How the checkpoint declares its PLE tables (`ple.declaration`): INT8, FP8, NVFP4 or BF16."""
    from qwen4_exp_hcu.ple.formats.declaration import declared_table_format, table_names

    config = vllm_config.model_config.hf_text_config
    qconfig = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
    return declared_table_format(config, qconfig, table_names(config))
