"""The Qwen4Exp PLE layer for a packed batch of variable-length requests.

Data flow: ids -> n-gram hash -> owned-row gather+dequant -> ETP combine (`lookup`, what the prefetch
workspace runs early) -> key/value projections -> grouped norms -> gate -> dilated causal short conv
(`forward`). The result is added to the hyper-connection streams by the caller.

Per-request state lives in caller-provided tensors indexed by a slot per request (what a serving
engine's per-request cache gives): the n-gram context ``[S, ngram_size-1]`` int64 and the short-conv
window ``[S, (K-1)*ngram_size, hc*hidden]``. Requests with slot < 0 are padding: never read, never written.
Tokens past ``query_start_loc[-1]`` are padding too (CUDA-graph batches): computed, never stored.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from qwen4_exp_hcu.ple.etp import ETPLookup, Group, owned_rows
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, next_ngram_context, ngram_ids
from qwen4_exp_hcu.ple.table import PLETable

_SHARD = re.compile(r"ple_embedding\.ngram_embedding\.shard_(\d+)\.(weight|weight_scale)$")
_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class GroupedRMSNorm(nn.Module):
    """RMSNorm over groups of `group` features, scaled by (1 + weight), computed in fp32."""

    def __init__(self, dim: int, group: int, eps: float, device=None):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float().unflatten(-1, (-1, self.group))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (h * (1.0 + self.weight.float())).type_as(x)


def write_state(state: torch.Tensor, slot_ids: torch.Tensor, rows: torch.Tensor) -> None:
    """state[slot] = row for real requests only (slot >= 0)."""
    if state.device.type == "cpu":
        from qwen4_exp_hcu.kernels.state_scatter import scatter_rows_reference as scatter
    else:
        from qwen4_exp_hcu.kernels.state_scatter import scatter_rows as scatter
    scatter(state, slot_ids, rows)


def state_shapes(text_config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-slot shapes of a PLE layer's (n-gram context, short-conv window), from the config alone
    (a serving engine sizes its state cache before any layer exists)."""
    window = (text_config.ple_conv_kernel_size - 1) * text_config.ngram_size
    return (text_config.ngram_size - 1,), (window, text_config.hc_count * text_config.hidden_size)


class PLELayer(nn.Module):
    def __init__(
        self,
        text_config,
        ple_layer_index: int,
        *,
        quantized: bool = False,
        device: torch.device | str = "cpu",
        host_table: bool = False,
        etp_group: Group | None = None,
        across_dp: bool = False,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        self.spec = spec = NgramHashSpec.from_config(text_config, ple_layer_index)
        self.hidden, self.hc = text_config.hidden_size, text_config.hc_count
        self.kernel = text_config.ple_conv_kernel_size
        self._state_shapes = state_shapes(text_config)
        self.state_len = self._state_shapes[1][0]
        embed_dim, width = spec.num_heads * spec.head_dim, self.hidden * self.hc
        world = etp_group.world_size if etp_group is not None else 1
        start, end = owned_rows(spec.rows, etp_group.rank_in_group if etp_group is not None else 0, world)
        shard_rows = -(-spec.rows // text_config.split_ngram_parts)
        self.table = PLETable(
            spec.rows, spec.head_dim, start=start, end=end, quantized=quantized,
            device=device, host=host_table, shard_rows=shard_rows,
        )
        self.etp = ETPLookup(self.table, etp_group, across_dp)
        kw = dict(device=device, dtype=dtype)
        self.key_proj = nn.Linear(embed_dim, width, bias=False, **kw)
        self.value_proj = nn.Linear(embed_dim, self.hidden, bias=False, **kw)
        eps = text_config.rms_norm_eps
        self.norm_key = GroupedRMSNorm(width, self.hidden, eps, device)
        self.norm_query = GroupedRMSNorm(width, self.hidden, eps, device)
        self.norm_conv = GroupedRMSNorm(width, self.hidden, eps, device)
        self.conv_weight = nn.Parameter(torch.zeros(width, self.kernel, **kw), requires_grad=False)
        self.requires_grad_(False)
        self._pending: dict[int, dict[str, torch.Tensor]] = {}

    # ---- state -------------------------------------------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of (n-gram context, short-conv window)."""
        return self._state_shapes

    def _request_context(self, slot_ids, ngram_state, has_initial_state):
        live = (has_initial_state & (slot_ids >= 0))[:, None]
        ctx = ngram_state[slot_ids.clamp(0, ngram_state.shape[0] - 1)]
        return torch.where(live, ctx, self.spec.eos_token_id)

    def check_inputs(self, hidden_states, input_ids, query_start_loc, slot_ids, ngram_state, conv_state, has_initial_state):
        """Shape/dtype/device errors always; value checks only for CPU tensors (no host syncs on accelerators)."""
        dev, B = input_ids.device, slot_ids.shape[0]
        expect = {
            "input_ids": (input_ids, (hidden_states.shape[0],), None),
            "query_start_loc": (query_start_loc, (B + 1,), None),
            "has_initial_state": (has_initial_state, (B,), torch.bool),
            "ngram_state": (ngram_state, (ngram_state.shape[0], self.spec.context_len), torch.int64),
            "conv_state": (conv_state, (conv_state.shape[0], self.state_len, self.hidden * self.hc), hidden_states.dtype),
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
            qsl = query_start_loc.long()
            if B and (qsl[0] != 0 or bool((qsl[1:] < qsl[:-1]).any()) or int(qsl[-1]) > input_ids.shape[0]):
                raise ValueError(
                    f"query_start_loc {qsl.tolist()} must start at 0, be non-decreasing and end at most at "
                    f"the token count {input_ids.shape[0]}."
                )
            for name, state in (("ngram_state", ngram_state), ("conv_state", conv_state)):
                if bool((slot_ids >= state.shape[0]).any()):
                    raise ValueError(f"slot_ids {slot_ids.tolist()} out of range for {name} with {state.shape[0]} slots.")

    # ---- compute -----------------------------------------------------------------------------
    def lookup(self, input_ids, query_start_loc, slot_ids, ngram_state, has_initial_state, out=None, max_tokens=None):
        """Hash + owned-row gather/dequant + ETP combine: [T] ids -> [T, ple_embed_dim] bf16."""
        ctx = self._request_context(slot_ids, ngram_state, has_initial_state)
        rows = ngram_ids(self.spec, input_ids, query_start_loc, ctx)
        return self.etp(rows, out=out, max_tokens=max_tokens)

    def _short_conv(self, x, query_start_loc, slot_ids, conv_state, has_initial_state):
        """Causal depthwise conv, kernel K, dilation N, over (window ++ chunk) of each request; updates the window."""
        T, B, L, N = x.shape[0], slot_ids.shape[0], self.state_len, self.spec.ngram_size
        qsl = query_start_loc.long()
        live = (has_initial_state & (slot_ids >= 0))[:, None, None]
        window = torch.where(live, conv_state[slot_ids.clamp(0, conv_state.shape[0] - 1)], 0)  # [B, L, C]

        def history(req, j, pos):  # row j of each request's (window ++ chunk), j < 0 inside the window
            from_chunk = x[pos.clamp(0, max(T - 1, 0))] if T else x.new_zeros(pos.shape[0], x.shape[1])
            return torch.where((j >= 0)[..., None], from_chunk, window[req, (L + j).clamp(0, L - 1)])

        pos = torch.arange(T, device=x.device)
        req = torch.searchsorted(qsl[1:], pos, right=True).clamp_max(max(B - 1, 0))
        i = pos - qsl[req]
        acc = torch.zeros_like(x)
        for k in range(self.kernel):
            lag = (self.kernel - 1 - k) * N
            acc = acc + history(req, i - lag, pos - lag) * self.conv_weight[:, k]
        # new window: the last L rows of (window ++ chunk)
        reqs = torch.arange(B, device=x.device)[:, None].expand(B, L)
        j = (qsl[1:] - qsl[:-1])[:, None] + torch.arange(-L, 0, device=x.device)
        new_window = history(reqs.reshape(-1), j.reshape(-1), (qsl[1:, None] - L + torch.arange(L, device=x.device)).reshape(-1))
        write_state(conv_state, slot_ids, new_window.view(B, L, x.shape[1]))
        return F.silu(acc)

    def forward(
        self, hidden_states, input_ids, query_start_loc, slot_ids, ngram_state, conv_state, has_initial_state,
        embeddings: torch.Tensor | None = None, max_tokens: int | None = None,
    ) -> torch.Tensor:
        """[T, hc*hidden] streams -> [T, hc*hidden] PLE output. `embeddings` = a prefetched `lookup`;
        `max_tokens` = most tokens on any ETP rank (across DP; avoids a count exchange)."""
        self.check_inputs(hidden_states, input_ids, query_start_loc, slot_ids, ngram_state, conv_state, has_initial_state)
        if embeddings is None:
            embeddings = self.lookup(input_ids, query_start_loc, slot_ids, ngram_state, has_initial_state, max_tokens=max_tokens)
        ctx = self._request_context(slot_ids, ngram_state, has_initial_state)
        write_state(ngram_state, slot_ids, next_ngram_context(self.spec, input_ids, query_start_loc, ctx))

        e = embeddings.to(hidden_states.dtype)
        T = hidden_states.shape[0]
        key = self.norm_key(self.key_proj(e)).view(T, self.hc, self.hidden)
        value = self.value_proj(e)
        query = self.norm_query(hidden_states).view(T, self.hc, self.hidden)
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value[:, None, :]).flatten(1)
        conv = self._short_conv(self.norm_conv(gated), query_start_loc, slot_ids, conv_state, has_initial_state)
        return gated + conv

    # ---- weights -----------------------------------------------------------------------------
    def load_weight(self, name: str, tensor: torch.Tensor, where: str = "") -> None:
        """Take one checkpoint tensor named relative to ``model.layers.{i}.ple.``."""
        full = f"{where}{name}"
        if m := _SHARD.search(name):
            j, kind = int(m.group(1)), m.group(2)
            part = self._pending.setdefault(j, {})
            part[kind] = tensor
            if kind == "weight_scale" or tensor.dtype != torch.int8:
                if "weight" in part:
                    del self._pending[j]
                    self.table.load_shard(j, part["weight"], part.get("weight_scale"), name=full.removesuffix("_scale"))
            return
        buf = name.removeprefix("ple_embedding.")
        if buf in _BUFFERS:
            self.spec.check_buffer(buf, tensor, f"{where}ple_embedding.")
            return
        params = {
            "key_proj.weight": self.key_proj.weight,
            "value_proj.weight": self.value_proj.weight,
            "norm_key.weight": self.norm_key.weight,
            "norm_query.weight": self.norm_query.weight,
            "norm_conv.weight": self.norm_conv.weight,
            "conv1d.weight": self.conv_weight,
        }
        if name not in params:
            raise ValueError(f"unexpected PLE checkpoint tensor {full}.")
        dst = params[name]
        src = tensor.reshape(dst.shape) if name == "conv1d.weight" and tensor.numel() == dst.numel() else tensor
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{full}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}.")
        dst.data.copy_(src)

    def finish_loading(self, where: str = "") -> None:
        """After all tensors: every owned shard arrived whole (int8 weights with their scales)."""
        if self._pending:
            j, part = next(iter(self._pending.items()))
            missing = "weight_scale" if "weight" in part else "weight"
            raise ValueError(f"{where}ple_embedding.ngram_embedding.shard_{j}.{missing} is missing from the checkpoint.")
        self.table.check_loaded(f"{where}ple_embedding.ngram_embedding")

    @classmethod
    def from_state_dict(cls, text_config, ple_layer_index: int, state_dict: dict, prefix: str = "", **kw) -> PLELayer:
        """Build from transformers-named tensors (e.g. `model.layers.0.ple.`-prefixed), BF16 or INT8 shards."""
        layer = cls(text_config, ple_layer_index, **kw)
        for name, t in state_dict.items():
            if name.startswith(prefix):
                layer.load_weight(name[len(prefix):], t, prefix)
        layer.finish_loading(prefix)
        return layer
