"""The tiny checkpoint loads in transformers, keeps the sharded PLE layout and decodes non-degenerately."""

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from qwen4_exp_hcu.tiny import load_config, make_tiny_checkpoint


def test_tiny_checkpoint_roundtrip(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny")
    config = load_config()
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for layer_id in config.ple_layer_ids:
        prefix = f"model.layers.{layer_id - 1}.ple.ple_embedding.ngram_embedding"
        assert {f"{prefix}.shard_{j}.weight" for j in range(config.split_ngram_parts)} <= keys

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token_id == config.eos_token_id
    assert tokenizer("t5 t17")["input_ids"] == [5, 17]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    continuations = set()
    for prompt in ([5, 17, 300, 42], [100, 101, 1, 102], [9]):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        tokens = tuple(out[0, len(prompt) :].tolist())
        assert len(set(tokens)) > 2, tokens  # not stuck on one token
        continuations.add(tokens)
    assert len(continuations) == 3
