"""Tiny transformers configs for PLE layer tests (no checkpoint needed)."""

from transformers import Qwen4ExpTextConfig

EOS = 7


def tiny_text_config(ngram_size=3, heads_per_ngram=2, ple_layer_ids=(1, 3), hidden=64, hc=2, **kw):
    base = dict(
        vocab_size=97,
        hidden_size=hidden,
        num_hidden_layers=4,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=hc,
        hc_lowrank=8,
        ple_layer_ids=list(ple_layer_ids),
        ple_embed_dim=(ngram_size - 1) * heads_per_ngram * 8,
        ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram,
        ngram_vocab_size_base=300,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
        eos_token_id=EOS,
    )
    base.update(kw)
    return Qwen4ExpTextConfig(**base)
