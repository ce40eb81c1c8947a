"""The Qwen4Exp PLE layer for a packed batch of variable-length requests (`PLEBatch`, `PLEState`).

Data flow: ids -> n-gram hash -> owned-row gather+dequant -> ETP combine (`lookup`, what the prefetch
workspace runs early) -> key/value projections -> grouped norms -> gate -> dilated causal short conv
(`forward`). The result is added to the hyper-connection streams by the caller.
"""

from __future__ import annotations

import torch
from torch import nn

from qwen4_exp_hcu.kernels import dispatch
from qwen4_exp_hcu.kernels.ple_gate import ple_gate, ple_gate_reference
from qwen4_exp_hcu.kernels.short_conv import current_window, short_conv, short_conv_reference, store_window, store_window_reference
from qwen4_exp_hcu.names import HASH_BUFFERS, LAYER_PARAMS, SCALE_SUFFIX, SHARD, TABLE, TABLE_SCALE, UNUSED
from qwen4_exp_hcu.norm import GroupedRMSNorm
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.etp import ETPLookup
from qwen4_exp_hcu.ple.formats.rows import FORMATS
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows
from qwen4_exp_hcu.ple.storage import PLEStorage


def state_shapes(text_config, num_speculative_tokens: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-slot shapes of a PLE layer's (n-gram context, short-conv window), from the config alone
    (a serving engine sizes its state cache before any layer exists); each keeps
    `num_speculative_tokens` more entries when drafts are verified (see `batch`)."""
    window = (text_config.ple_conv_kernel_size - 1) * text_config.ngram_size
    extra = num_speculative_tokens
    return (text_config.ngram_size - 1 + extra,), (window + extra, text_config.hc_count * text_config.hidden_size)


def write_window(stored: torch.Tensor, batch: PLEBatch, chunk: torch.Tensor, length: int, fill) -> None:
    """Store each real request's new window (the last `length` entries of its window ++ chunk, more when it
    verifies drafts) in its slot; padding requests write nothing."""
    dispatch(store_window, store_window_reference, stored, chunk, batch.query_start_loc, batch.slot_ids,
             batch.has_initial_state, batch.num_accepted, batch.verify, length, fill)  # fmt: skip


# the scales a table shard comes with, by its weight's dtype (BF16/F32 and FP8 shards have none)
_SHARD_PARTS = {getattr(torch, f.weight): {SCALE_SUFFIX} for f in FORMATS.values() if f.row_scale}
_OLD_LAYOUT = (
    "this checkpoint has a copy of the table scale in every shard; upstream vLLM and the releases keep one "
    "per table (`...ngram_embedding.weight_scale` for FP8, `weight_scale_2` for NVFP4). Re-quantize from the BF16 "
    "checkpoint: python -m qwen4_exp_hcu.quantize BF16_SRC DST --format nvfp4"
)


class _Conv1dWeight(nn.Module):
    """Holds `conv1d.weight` [hc*hidden, 1, K] under the checkpoint's name (depthwise, no bias)."""

    def __init__(self, channels: int, size: int, **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, size, **kw), requires_grad=False)


class PLELayer(nn.Module):
    """The PLE of one decoder layer; its table is stored and sharded as `storage` says, its parameters are `dtype`."""

    def __init__(
        self, text_config, ple_layer_index: int, storage: PLEStorage = PLEStorage(), dtype: torch.dtype = torch.bfloat16
    ):
        super().__init__()
        self.spec = spec = NgramHashSpec.from_config(text_config, ple_layer_index)
        self.hidden, self.hc = text_config.hidden_size, text_config.hc_count
        self.conv_size = text_config.ple_conv_kernel_size
        self._config = text_config
        self.state_len = state_shapes(text_config)[1][0]
        embed_dim, width = spec.num_heads * spec.head_dim, self.hidden * self.hc
        shard_rows = -(-spec.rows // text_config.split_ngram_parts)
        self.etp = ETPLookup(spec.rows, spec.head_dim, storage.scoped(f"ple{ple_layer_index}"), shard_rows)
        device = storage.device
        kw = dict(device=device, dtype=dtype)
        self.key_proj = nn.Linear(embed_dim, width, bias=False, **kw)
        self.value_proj = nn.Linear(embed_dim, self.hidden, bias=False, **kw)
        eps = text_config.rms_norm_eps
        self.norm_key = GroupedRMSNorm(width, self.hidden, eps, device)
        self.norm_query = GroupedRMSNorm(width, self.hidden, eps, device)
        self.norm_conv = GroupedRMSNorm(width, self.hidden, eps, device)
        self.conv1d = _Conv1dWeight(width, self.conv_size, **kw)
        self.requires_grad_(False)
        self._pending: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def table(self):
        return self.etp.table

    # ---- state -------------------------------------------------------------------------------
    def state_shapes(self, num_speculative_tokens: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of (n-gram context, short-conv window)."""
        return state_shapes(self._config, num_speculative_tokens)

    def _request_context(self, batch: PLEBatch, state: PLEState) -> torch.Tensor:
        return current_window(state.ngram, batch.slot_ids, batch.has_initial_state, batch.num_accepted,
                              self.spec.context_len, self.spec.eos_token_id)  # fmt: skip

    def check_inputs(self, hidden_states: torch.Tensor, batch: PLEBatch, state: PLEState) -> None:
        """Shape/dtype/device errors always; value checks only for CPU tensors (no host syncs on accelerators)."""
        dev, B = batch.input_ids.device, batch.num_requests
        extra = max(state.ngram.shape[-1] - self.spec.context_len, 0)  # speculative entries
        expect = {
            "input_ids": (batch.input_ids, (hidden_states.shape[0],), None),
            "query_start_loc": (batch.query_start_loc, (B + 1,), None),
            "has_initial_state": (batch.has_initial_state, (B,), torch.bool),
            "ngram_state": (state.ngram, (state.ngram.shape[0], self.spec.context_len + extra), torch.int64),
            "conv_state": (state.conv, (state.conv.shape[0], self.state_len + extra, self.hidden * self.hc), hidden_states.dtype),
            **({} if batch.verify is None else {"verify": (batch.verify, (B,), torch.bool)}),
            **({} if batch.num_accepted is None else {"num_accepted": (batch.num_accepted, (B,), None)}),
        }
        for name, (t, shape, dtype) in expect.items():
            if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype) or t.device != dev:
                raise ValueError(
                    f"PLE {name}: got {t.dtype} {tuple(t.shape)} on {t.device}, expected "
                    f"{dtype or 'integer'} {shape} on {dev}."
                )
        if hidden_states.shape[-1] != self.hidden * self.hc:
            raise ValueError(f"PLE hidden_states has {hidden_states.shape[-1]} features, expected hc*hidden={self.hidden * self.hc}.")
        if dev.type == "cpu":
            qsl = batch.query_start_loc.long()
            if B and (qsl[0] != 0 or bool((qsl[1:] < qsl[:-1]).any()) or int(qsl[-1]) > batch.num_tokens):
                raise ValueError(
                    f"query_start_loc {qsl.tolist()} must start at 0, be non-decreasing and end at most at "
                    f"the token count {batch.num_tokens}."
                )
            for name, t in (("ngram_state", state.ngram), ("conv_state", state.conv)):
                if bool((batch.slot_ids >= t.shape[0]).any()):
                    raise ValueError(f"slot_ids {batch.slot_ids.tolist()} out of range for {name} with {t.shape[0]} slots.")
            if batch.num_accepted is not None and bool(((batch.num_accepted < 1) | (batch.num_accepted > extra + 1)).any()):
                raise ValueError(
                    f"num_accepted {batch.num_accepted.tolist()} must be in 1..{extra + 1} for a state with {extra} "
                    "speculative entries."
                )
            if batch.verify is not None and bool((batch.verify & (qsl[1:] - qsl[:-1] > extra + 1)).any()):
                raise ValueError(f"a verifying request sends at most {extra + 1} tokens (its last + {extra} drafts).")

    # ---- compute -----------------------------------------------------------------------------
    def lookup(self, batch: PLEBatch, state: PLEState, out: torch.Tensor | None = None) -> torch.Tensor:
        """Hash + owned-row gather/dequant + ETP combine: [T] ids -> [T, ple_embed_dim] bf16 (into `out`).
        Reads the n-gram context of `state`; writes nothing."""
        rows = ngram_ids(self.spec, batch.input_ids, batch.query_start_loc, self._request_context(batch, state))
        if self.table.file_rows is not None:  # padding tokens (a graph's batch size) read no file and count for nothing
            padding = torch.arange(rows.shape[0], device=rows.device) >= batch.real_tokens
            rows = rows.masked_fill(padding[:, None], -1)
        return self.etp(rows, out=out, max_tokens=batch.max_tokens)

    def forward(
        self, hidden_states: torch.Tensor, batch: PLEBatch, state: PLEState,
        embeddings: torch.Tensor | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[T, hc*hidden] streams -> [T, hc*hidden] PLE output (into `out` when given); updates `state`
        for the real requests. `embeddings` = this step's `lookup`, when it was started early."""
        self.check_inputs(hidden_states, batch, state)
        if embeddings is None:
            embeddings = self.lookup(batch, state)
        write_window(state.ngram, batch, batch.input_ids, self.spec.context_len, self.spec.eos_token_id)

        e = embeddings.to(hidden_states.dtype)
        # per stream: sigmoid(sign(g) sqrt|g|) * value, g = <norm_key(key), norm_query(streams)> / sqrt(hidden)
        gated, x = dispatch(ple_gate, ple_gate_reference, self.key_proj(e), hidden_states, self.value_proj(e),
                            self.norm_key.weight, self.norm_query.weight, self.norm_conv.weight, self.norm_conv.eps,
                            self.hidden)  # fmt: skip
        # gated + silu(causal depthwise conv, dilation ngram_size, over each request's window ++ chunk of norm_conv(gated))
        out = dispatch(short_conv, short_conv_reference, x, gated, state.conv, batch.query_start_loc, batch.slot_ids,
                       batch.has_initial_state, batch.num_accepted, self.conv1d.weight[:, 0], self.spec.ngram_size, out=out)  # fmt: skip
        write_window(state.conv, batch, x, self.state_len, 0)  # after the conv has read the windows
        return out

    # ---- weights -----------------------------------------------------------------------------
    def load_weight(self, name: str, tensor: torch.Tensor, prefix: str = "") -> None:
        """Take one checkpoint tensor named relative to `model.layers.{i}.ple.` (`prefix`, for errors):
        a table shard, a hash buffer (checked against the config), a layer parameter, or statistics that
        are skipped; anything else is an error naming the tensor."""
        if UNUSED.search(name):
            return
        if TABLE_SCALE.search(name):
            self.table.set_table_scale(tensor, f"{prefix}{name}")
        elif m := SHARD.search(name):
            kind = m.group(2)
            if kind == "weight_scale_2" or kind == self.table.format.table_scale:
                raise ValueError(f"{prefix}{name}: a per-shard table scale. {_OLD_LAYOUT}.")
            self._load_shard(int(m.group(1)), kind, tensor, f"{prefix}{name}")
        elif name.removeprefix("ple_embedding.") in HASH_BUFFERS:
            self.spec.check_buffer(name.removeprefix("ple_embedding."), tensor, f"{prefix}ple_embedding.")
        elif name in LAYER_PARAMS:
            dst = self.get_parameter(name)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"{prefix}{name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}.")
            dst.data.copy_(tensor)
        else:
            raise ValueError(f"unexpected PLE checkpoint tensor {prefix}{name}.")

    def _load_shard(self, j: int, kind: str, tensor: torch.Tensor, full_name: str) -> None:
        """A shard arrives as its weight plus, by the weight's dtype, its row scales (any order): load it
        once every part is here (int8: weight_scale per row; nvfp4 packed bytes: weight_scale per block)."""
        part = self._pending.setdefault(j, {})
        part[kind] = tensor
        if "weight" in part and _SHARD_PARTS.get(part["weight"].dtype, set()) <= part.keys():
            del self._pending[j]
            name = full_name.rpartition(".")[0] + ".weight"
            self.table.load_shard(j, part["weight"], part.get("weight_scale"), name=name)

    def finish_loading(self, prefix: str = "") -> None:
        """After all tensors: every owned shard arrived whole (int8 weights with their scales)."""
        if self._pending:
            j, part = next(iter(self._pending.items()))
            need = {"weight"} | (_SHARD_PARTS.get(part["weight"].dtype, set()) if "weight" in part else set())
            missing = sorted(need - part.keys())[0]
            raise ValueError(f"{prefix}{TABLE}.shard_{j}.{missing} is missing from the checkpoint.")
        self.table.check_loaded(f"{prefix}{TABLE}")

    def enable_hot_rows(self, gpu_bytes: int, calibration_tokens: torch.Tensor | None = None) -> HotRows:
        """Keep this rank's most used table rows in `gpu_bytes` of accelerator memory (row map included):
        the rows most frequent in `calibration_tokens` (one token stream, EOS between documents), or,
        without them, the rows served traffic reads most (see `ple.hot_rows`)."""
        t, observe = self.table, calibration_tokens is None
        row_bytes = t.format.row_bytes(t.dim)
        slots = HotRows.slots_for(gpu_bytes, t.end - t.start, row_bytes, observe)
        if slots < 1:
            raise ValueError(
                f"hot_rows_gib: {gpu_bytes / 2**30:.4f} GiB per PLE layer cannot hold the row map of this rank's "
                f"{t.end - t.start} rows ({HotRows.bytes_needed(t.end - t.start, 0, row_bytes, observe) / 2**30:.4f} GiB)."
            )
        hot = t.enable_hot_rows(slots, observe)
        if not observe:
            hot.fill(self.calibration_ids(calibration_tokens))
        return hot

    def calibration_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """This layer's table row ids of one calibration token stream (EOS context before it)."""
        tokens = tokens.to(self.table.compute_device, torch.int64)
        qsl = torch.tensor([0, tokens.numel()], device=tokens.device)
        context = torch.full((1, self.spec.context_len), self.spec.eos_token_id, device=tokens.device)
        return ngram_ids(self.spec, tokens, qsl, context)

    @classmethod
    def from_state_dict(
        cls, text_config, ple_layer_index: int, state_dict: dict, prefix: str = "",
        storage: PLEStorage = PLEStorage(), dtype: torch.dtype = torch.bfloat16,
    ) -> PLELayer:  # fmt: skip
        """Build from transformers-named tensors (e.g. `model.layers.0.ple.`-prefixed), BF16 or INT8 shards."""
        layer = cls(text_config, ple_layer_index, storage, dtype)
        for name, t in state_dict.items():
            if name.startswith(prefix):
                layer.load_weight(name[len(prefix):], t, prefix)
        layer.finish_loading(prefix)
        return layer
