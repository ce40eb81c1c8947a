"""PLE layers loaded from checkpoint directories (BF16 and quantizer output) vs transformers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.checkpoint import load_ple_layer
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.quantize import quantize_checkpoint
from qwen4_exp_hcu.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    make_tiny_checkpoint(root / "bf16")
    quantize_checkpoint(root / "bf16", root / "int8")
    return root


def test_layer_from_checkpoint_equals_transformers(checkpoints):
    hf = AutoModelForCausalLM.from_pretrained(checkpoints / "bf16", dtype=torch.float32)
    cfg = hf.config
    layer_id = cfg.ple_layer_ids[1]
    ours = load_ple_layer(checkpoints / "bf16", layer_id, dtype=torch.float32)
    hs = torch.randn(1, 9, cfg.hc_count * cfg.hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        want = hf.model.layers[layer_id - 1].ple(hs, ids, None)[0]
    state = PLEState.zeros(ours.state_shapes(), 2, torch.float32)
    got = ours(hs[0], PLEBatch.from_lengths(ids[0], [9], [1], [False]), state)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_int8_checkpoint_equals_bf16_quantized_on_load(checkpoints):
    a = load_ple_layer(checkpoints / "int8", 3)
    b = load_ple_layer(checkpoints / "bf16", 3, PLEStorage("int8"))
    assert a.table.quantized and torch.equal(a.table.weight, b.table.weight) and torch.equal(a.table.scale, b.table.scale)


def _broken_copy(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    edit(tensors, cfg)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t, c: t.pop("model.layers.0.ple.ple_embedding.ngram_embedding.shard_2.weight"), r"shard_2.weight is missing"),
        (lambda t, c: t.pop("model.layers.0.ple.ple_embedding.ngram_embedding.shard_3.weight_scale"), "shard_3.weight_scale is missing"),
        (lambda t, c: t.update({"model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight_scale":
                                t["model.layers.0.ple.ple_embedding.ngram_embedding.shard_1.weight_scale"].float()}), "shard_1.weight_scale"),
        (lambda t, c: t["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight_scale"].fill_(float("inf")), "shard_0.weight_scale"),
        (lambda t, c: t.update({"model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight":
                                t["model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"][:, :-1].contiguous()}), "shard_0.weight"),
        (lambda t, c: c.update(seed=c.get("seed", 1234) + 1), "layer_multipliers"),
    ],
)
def test_broken_checkpoints_fail_at_load_naming_the_tensor(checkpoints, tmp_path, edit, match):
    broken = _broken_copy(checkpoints / "int8", tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=match):
        load_ple_layer(broken, 1)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_upstream_layout_checkpoint_loads_as_declared(checkpoints, tmp_path, fmt):
    """`load_ple_layer` reads the format the checkpoint declares (`ple_embedding_dtype` here; every way:
    tests/test_declaration.py) and keeps it: lookups equal a BF16 layer holding the decoded rows."""
    from helpers.checkpoints import upstream_table_checkpoints

    served = upstream_table_checkpoints(checkpoints / "bf16", tmp_path / fmt, tmp_path / "oracle", fmt)
    ours, ref = load_ple_layer(served, 3), load_ple_layer(tmp_path / "oracle", 3)
    assert ours.table.format.name == fmt and ref.table.format.name == "bf16"
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(0))
    batch = PLEBatch.from_lengths(ids, [12], [0], [False])
    state = lambda: PLEState.zeros(ref.state_shapes(), 1, torch.bfloat16)  # noqa: E731
    assert torch.equal(ours.lookup(batch, state()), ref.lookup(batch, state()))
