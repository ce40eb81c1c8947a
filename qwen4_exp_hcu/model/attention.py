"""`indexed_attention` layers: gated GQA attention whose keys are pre-selected by the QSA indexer.

QSA lets each query attend to at most `indexer_budget` tokens chosen from mean-pooled key blocks of
`indexer_compress_ratio` tokens (plus the unpooled tail). While every sequence has at most
`indexer_budget` tokens, every complete block is selected and QSA is exactly dense causal attention,
so we run vLLM's dense `Attention` then. Longer contexts need the real QSA kernels: on CUDA-alike
platforms vLLM's own Qwen4Exp QSA attention is imported (`vllm_api.qsa_attention_builder`); elsewhere the
configuration is rejected.
"""

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope


def dense_attention_is_exact(config, max_model_len: int) -> bool:
    """True when no sequence can exceed the QSA budget (or QSA is not configured at all)."""
    budget = getattr(config, "indexer_budget", None)
    return budget is None or max_model_len <= budget


def check_dense_attention_allowed(config, max_model_len: int, platform_name: str) -> None:
    """Reject, before any weight is loaded, a CPU-style setup that would silently diverge from QSA."""
    if not dense_attention_is_exact(config, max_model_len):
        raise ValueError(
            f"Qwen4Exp indexed attention on {platform_name} runs as dense attention, which equals QSA only "
            f"while a sequence fits the indexer budget: max_model_len={max_model_len} > "
            f"indexer_budget={config.indexer_budget}. Set --max-model-len <= {config.indexer_budget}."
        )


class DenseGatedAttention(nn.Module):
    """Qwen3.5-style attention: per-head output gate packed in `q_proj`, zero-centred q/k norms, partial RoPE."""

    def __init__(self, config, vllm_config, prefix: str) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        if total_heads % tp_size:
            raise ValueError(f"num_attention_heads={total_heads} is not divisible by TP size {tp_size}")
        self.num_heads = total_heads // tp_size
        self.num_kv_heads = max(1, total_kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        quant_config = vllm_config.quant_config
        # "q" rows hold [q_h, gate_h] per head, exactly like the checkpoint's q_proj.
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            2 * total_heads,
            total_kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # M-RoPE when the checkpoint keeps its sections: positions are [3, T] with images, [T] for text.
        self.rotary_emb = get_rope(
            head_size=self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous()).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v) * torch.sigmoid(gate.flatten(-2))
        out, _ = self.o_proj(out)
        return out
