"""Hyper-connections (transformers' `Qwen4ExpTextGatedResidual`) on vLLM linears.

The residual is `hc_count` parallel streams packed as `[T, hc_count * hidden]`. Before a block, a
gated low-rank mix collapses the (normalised) streams into the block input; after it, the block
output is injected back into every stream with a per-stream weight `2 * sigmoid(.)`.
The matrices are tiny (rank `hc_lowrank`), so they are replicated across TP ranks. The glue between
them runs as three kernels (`kernels.hyper_connection`); the previous block's injection is fused
with the streams' norm, and at decode sizes the down GEMM with its silu (`kernels.down_silu`).
"""

import torch
from torch import nn
from vllm import envs
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear

from qwen4_exp_hcu.kernels import dispatch, torch_ops
from qwen4_exp_hcu.kernels.down_silu import DOWN_SILU_TILES, configured_launch, down_silu
from qwen4_exp_hcu.kernels.hyper_connection import (
    gate_mix,
    gate_mix_reference,
    inject_norm,
    inject_norm_reference,
    scaled_silu,
    scaled_silu_reference,
)
from qwen4_exp_hcu.norm import GroupedRMSNorm


Pending = tuple[torch.Tensor, torch.Tensor]  # a block's output and its injection weights, not yet injected
# `down_silu` serves up to 32 tokens; the model fuses up to 16: in serving at the release's geometry the GEMM library
# is as fast at 32 tokens, though the kernel timed alone is not (docs/PERFORMANCE.md)
FUSED_DOWN_MAX_TOKENS = 16


class GatedResidual(nn.Module):
    """Mix `hc_count` residual streams into one block input (and, with `use_combine`, injection weights)."""

    def __init__(self, config, prefix: str, use_combine: bool = True) -> None:
        super().__init__()
        self.hc_count = config.hc_count
        self.hidden_size = config.hidden_size
        self.use_combine = use_combine
        hc_hidden = self.hc_count * self.hidden_size
        self.hc_norm = GroupedRMSNorm(hc_hidden, self.hidden_size, config.rms_norm_eps)
        # the down projection and the injection logits read the same normed streams: one GEMM
        # (checkpoint: `input_mix_weight_down` and `block_inject_weight`, see the model's stacked names)
        self.sizes = [config.hc_lowrank] + [self.hc_count] * use_combine
        # its output rows padded to 16 columns, as vLLM's class pads them: for the release's 320 + 4 bf16 (648 B)
        # cuBLAS takes align-2 kernels, 2.2x slower than vLLM's class at b = 256 on the H200. The padding's weight
        # rows are zeros, which `down_silu` does not read (as vLLM's CuTe kernel skips them).
        pad = -sum(self.sizes) % 16
        self.input_mix_weight_down_block_inject = MergedColumnParallelLinear(
            hc_hidden, self.sizes + [pad] * (pad > 0), bias=False, disable_tp=True, return_bias=False,
            prefix=f"{prefix}.input_mix_weight_down_block_inject",
        )  # fmt: skip
        if pad:  # no checkpoint has this shard: it is loaded here, so vLLM's loader finds every shard filled
            linear = self.input_mix_weight_down_block_inject
            linear.weight_loader(linear.weight, linear.weight.new_zeros(pad, hc_hidden), len(self.sizes))
        self.register_buffer("down_silu_counts", torch.zeros(DOWN_SILU_TILES, dtype=torch.int32), persistent=False)
        self.input_mix_weight_up = ReplicatedLinear(
            config.hc_lowrank, hc_hidden, bias=False, return_bias=False, prefix=f"{prefix}.input_mix_weight_up"
        )

    def forward(
        self, streams: torch.Tensor, pending: Pending | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block input mixed from `streams` once `pending` (the previous block's output and its injection
        weights) is injected into them; with `use_combine`, (those streams, the block input, its weights)."""
        block_out, weights = pending or (None, None)
        norm = self.hc_norm
        streams, normed = dispatch(inject_norm, inject_norm_reference, streams, norm.weight, norm.eps,
                                   norm.group_size, block_out, weights)  # fmt: skip
        # the one GEMM's output: down (through the silu), then logits and padding, read in place by the mix
        linear, rank, scale = self.input_mix_weight_down_block_inject, self.sizes[0], float(self.hc_count)
        if self._fuse_down(normed):
            weight, counts = linear.weight[: sum(self.sizes)], self.down_silu_counts
            down, rest = down_silu(normed, weight, rank, scale, counts, configured_launch())
        else:
            merged = linear(normed)
            down, rest = dispatch(scaled_silu, scaled_silu_reference, merged[:, :rank], scale), merged[:, rank:]
        logits = rest[:, : self.hc_count] if self.use_combine else None
        up = self.input_mix_weight_up(down)
        mixed, weights = dispatch(gate_mix, gate_mix_reference, up, normed, self.hc_count, logits)
        return mixed if logits is None else (streams, mixed, weights)

    @staticmethod
    def _fuse_down(normed: torch.Tensor) -> bool:
        """Decode sizes on an accelerator, eagerly or in a CUDA graph: the GEMM and the silu in one launch. Not on
        the CPU (vLLM repacks the weight for its own GEMM there), not under torch.compile (Inductor fuses the
        references; no guard on the batch size), not in vLLM's batch-invariant mode (the kernel's sum order
        changes with the batch), nor where `QWEN4_EXP_HCU_TORCH_OPS` names it."""
        if torch.compiler.is_compiling() or normed.device.type != "cuda" or envs.VLLM_BATCH_INVARIANT:
            return False
        if "down_silu" in torch_ops():
            return False  # its torch reference is the GEMM library's path
        return 1 <= normed.shape[0] <= FUSED_DOWN_MAX_TOKENS


def inject(streams: torch.Tensor, block_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`streams + weights[s] * block_out` for every stream `s` (`[T, hc*H]`, `[T, H]`, `[T, hc]`)."""
    return dispatch(inject_norm, inject_norm_reference, streams, None, 0.0, block_out.shape[-1], block_out, weights)[0]
