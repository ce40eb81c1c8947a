"""N-gram hash (`ple.hashing`): parity with transformers, chunking, checkpoint buffers, bad config."""

import pytest
import torch
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

from helpers.configs import EOS, tiny_text_config
from helpers.steps import pack, random_prompts
from qwen4_exp_hcu.kernels.ngram_hash import ngram_hash
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids_reference
from qwen4_exp_hcu.names import HASH_BUFFERS


def hf_ids(cfg, ple_index, prompts):
    """transformers' ids for each prompt run alone: table row r holds r in column 0 of every head."""
    emb = Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, 0, ple_index)
    with torch.no_grad():
        emb.ngram_embedding.weight.zero_()
        emb.ngram_embedding.weight[:, 0] = torch.arange(emb.ngram_embedding.weight.shape[0])
    spec = NgramHashSpec.from_config(cfg, ple_index)
    out = []
    for p in prompts:
        e = emb(torch.tensor([p]), None)[0].view(len(p), spec.num_heads, spec.head_dim)
        out.append(e[:, :, 0].round().long())
    return out


@pytest.mark.parametrize("ngram_size", [2, 3, 4])
@pytest.mark.parametrize("heads_per_ngram", [1, 3, 8])
def test_packed_ids_equal_transformers(ngram_size, heads_per_ngram):
    cfg = tiny_text_config(ngram_size=ngram_size, heads_per_ngram=heads_per_ngram)
    gen = torch.Generator().manual_seed(ngram_size * 10 + heads_per_ngram)
    prompts = random_prompts(gen, 5, 12) + [[EOS, 3, 4, EOS, EOS, 5, 6, 8]]
    for ple_index in (0, 1):
        spec = NgramHashSpec.from_config(cfg, ple_index)
        ids, qsl = pack(prompts)
        ctx = torch.full((len(prompts), ngram_size - 1), EOS)
        ours = ngram_ids_reference(spec, ids, qsl, ctx)
        assert torch.equal(ours, torch.cat(hf_ids(cfg, ple_index, prompts)))
        assert torch.equal(ngram_hash(spec, ids, qsl, ctx), ours)


def test_chunked_prefill_equals_one_shot():
    cfg = tiny_text_config(ngram_size=4, heads_per_ngram=2)
    spec = NgramHashSpec.from_config(cfg, 0)
    gen = torch.Generator().manual_seed(0)
    prompts = random_prompts(gen, 4, 20)
    ids, qsl = pack(prompts)
    ctx = torch.full((4, 3), EOS)
    full = ngram_ids_reference(spec, ids, qsl, ctx)
    # feed every request in chunks of 1..3 tokens, interleaved in one packed batch per step
    done = [0] * 4
    got = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks = []
        for r, p in enumerate(prompts):
            step = int(torch.randint(1, 4, (1,), generator=gen))
            chunks.append(p[done[r] : done[r] + step])
        c_ids, c_qsl = pack(chunks)
        rows = ngram_hash(spec, c_ids, c_qsl, ctx)
        assert torch.equal(rows, ngram_ids_reference(spec, c_ids, c_qsl, ctx))
        for r in range(4):
            got[r].append(rows[c_qsl[r] : c_qsl[r + 1]])
            done[r] += len(chunks[r])
        ctx = torch.stack([torch.cat([ctx[r], torch.as_tensor(c)])[-3:] for r, c in enumerate(chunks)])  # last N-1 tokens
    assert torch.equal(torch.cat([torch.cat(g) for g in got]), full)


def test_checkpoint_buffers_checked():
    cfg = tiny_text_config()
    spec = NgramHashSpec.from_config(cfg, 0)
    emb = Qwen4ExpTextNGramEmbedding(cfg, cfg.ple_embed_dim, 0, 0)
    for name in HASH_BUFFERS:
        spec.check_buffer(name, getattr(emb, name))
    with pytest.raises(ValueError, match="layers.0.ple.ple_embedding.layer_multipliers"):
        spec.check_buffer("layer_multipliers", emb.layer_multipliers + 2, "layers.0.ple.ple_embedding.")
    with pytest.raises(ValueError, match="ngram_heads_offsets"):
        spec.check_buffer("ngram_heads_offsets", emb.ngram_heads_offsets.flip(0))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(ple_embed_dim=30), "ple_embed_dim=30 is not divisible"),
        (dict(ple_layer_ids=[2]), r"ple_layer_ids \[2\] are not linear_attention"),
        (dict(ple_layer_ids=[9]), "1-indexed"),
        (dict(eos_token_id=None), "eos_token_id must be set"),
    ],
)
def test_bad_config_named(change, match):
    cfg = tiny_text_config()
    for k, v in change.items():
        object.__setattr__(cfg, k, v)  # bypass transformers' own validation: configs can arrive from elsewhere
    with pytest.raises(ValueError, match=match):
        NgramHashSpec.from_config(cfg, 0)


def test_a_config_without_seed_hashes_with_transformers_default():
    """vLLM 0.29-0.30's own config class declares no `seed` (releases' config.json carry none): the hash takes
    transformers' default, as those releases' PLE layers do."""
    cfg = tiny_text_config()
    assert cfg.seed == 1234  # transformers' default, which the multipliers below were computed with
    expected = NgramHashSpec.from_config(cfg, 0).multipliers
    undeclared = type("ConfigWithoutSeed", (), {k: v for k, v in cfg.to_dict().items() if k != "seed"})()
    undeclared.layer_types, undeclared.eos_token_id = cfg.layer_types, cfg.eos_token_id
    assert NgramHashSpec.from_config(undeclared, 0).multipliers == expected
    cfg.seed = 99
    assert NgramHashSpec.from_config(cfg, 0).multipliers != expected  # the seed reaches the multipliers
