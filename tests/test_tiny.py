"""The tiny checkpoint loads in transformers, keeps the sharded PLE layout and decodes non-degenerately."""

import pytest
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


def test_teacher_forced_greedy_equals_step_by_step_greedy(tiny):
    """`reference_greedy`, the vLLM tests' oracle, gives the tokens and log-probabilities of plain step-by-step
    greedy decoding (one forward per new token), whatever continuation it is handed first: the right one, a
    wrong one or none."""
    from helpers.scenarios import PROMPTS

    from qwen4_exp_hcu.tiny import reference_greedy

    prompts, new_tokens = PROMPTS[1:3], 12
    model = AutoModelForCausalLM.from_pretrained(tiny["bf16"], dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            seq, rows = list(prompt), []
            for _ in range(new_tokens):
                logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
                rows.append(logits.log_softmax(-1))
                seq.append(int(logits.argmax()))
            expected.append({"tokens": seq[len(prompt) :], "logprobs": torch.stack(rows)})
    right = [r["tokens"] for r in expected]
    wrong = [t[:5] + [(t[5] + 1) % 500] + t[6:] for t in right]
    for candidates in (right, wrong, None):
        for got, want in zip(reference_greedy(tiny["bf16"], prompts, new_tokens, candidates), expected, strict=True):
            assert got["tokens"] == want["tokens"]
            torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "nvfp4"])
def test_random_tables_are_stored_as_their_format_reads_them(tmp_path, fmt):
    """`write_random_tables`: every PLE layer's table whole in `fmt`'s checkpoint layout, shard by shard as the config
    splits it, the hash buffers the config implies, and values that dequantize (the format's reference) to N(0, 1)."""
    from qwen4_exp_hcu.names import ple_layers
    from qwen4_exp_hcu.ple.formats.rows import FORMATS
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec
    from qwen4_exp_hcu.tiny import write_random_tables

    config, form = load_config(ngram_vocab_size_base=3000), FORMATS[fmt]
    files = write_random_tables(tmp_path, config, fmt)
    tensors = {}
    for file in set(files.values()):
        with safe_open(tmp_path / file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert set(tensors) == set(files)
    for layer in ple_layers(config):
        spec, table = NgramHashSpec.from_config(config, layer.ple), f"{layer.prefix}ple_embedding.ngram_embedding"
        for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            spec.check_buffer(name, tensors[f"{layer.prefix}ple_embedding.{name}"])
        table_scale = tensors.get(f"{table}.{form.table_scale}")
        assert (table_scale is not None) == bool(form.table_scale)
        rows = []
        for j in range(config.split_ngram_parts):
            weight, scale = tensors[f"{table}.shard_{j}.weight"], tensors.get(f"{table}.shard_{j}.weight_scale")
            assert str(weight.dtype) == f"torch.{form.weight}" and (scale is not None) == (form.row_scale is not None)
            rows.append(form.dequantize(weight, scale, table_scale).float())
        values = torch.cat(rows)
        assert values.shape == (spec.rows, spec.head_dim)
        assert values.isfinite().all() and abs(values.mean()) < 0.05 and 0.9 < values.std() < 1.1
