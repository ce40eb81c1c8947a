"""Hyper-connections (transformers' `Qwen4ExpTextGatedResidual`) on vLLM linears.

The residual is `hc_count` parallel streams packed as `[T, hc_count * hidden]`. Before a block, a
gated low-rank mix collapses the (normalised) streams into the block input; after it, the block
output is injected back into every stream with a per-stream weight `2 * sigmoid(.)`.
The matrices are tiny (rank `hc_lowrank`), so they are replicated across TP ranks.
"""

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.linear import ReplicatedLinear

from qwen4_exp_hcu.norm import GroupedRMSNorm


class GatedResidual(nn.Module):
    """Mix `hc_count` residual streams into one block input (and, with `use_combine`, injection weights)."""

    def __init__(self, config, prefix: str, use_combine: bool = True) -> None:
        super().__init__()
        self.hc_count = config.hc_count
        self.hidden_size = config.hidden_size
        hc_hidden = self.hc_count * self.hidden_size
        self.hc_norm = GroupedRMSNorm(hc_hidden, self.hidden_size, config.rms_norm_eps)
        self.input_mix_weight_down = ReplicatedLinear(
            hc_hidden, config.hc_lowrank, bias=False, prefix=f"{prefix}.input_mix_weight_down"
        )
        self.input_mix_weight_up = ReplicatedLinear(
            config.hc_lowrank, hc_hidden, bias=False, prefix=f"{prefix}.input_mix_weight_up"
        )
        self.block_inject_weight = (
            ReplicatedLinear(hc_hidden, self.hc_count, bias=False, prefix=f"{prefix}.block_inject_weight")
            if use_combine
            else None
        )

    def forward(self, streams: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        normed = self.hc_norm(streams)
        down, _ = self.input_mix_weight_down(normed)
        up, _ = self.input_mix_weight_up(F.silu(down / self.hc_count))
        mix = torch.sigmoid(up).unflatten(-1, (self.hc_count, self.hidden_size))
        mixed = (mix * normed.unflatten(-1, (self.hc_count, self.hidden_size))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed
        inject, _ = self.block_inject_weight(normed)
        return mixed, 2 * torch.sigmoid(inject / self.hc_count)


def inject(streams: torch.Tensor, block_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`streams + weights[s] * block_out` for every stream `s` (`[T, hc*H]`, `[T, H]`, `[T, hc]`)."""
    return streams + (weights.unsqueeze(-1) * block_out.unsqueeze(-2)).flatten(-2)
