"""The checkpoint quantizer on a tiny random Qwen4Exp, checked through compressed-tensors' own loaders."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_quantizable_tensors
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwen4_exp_hcu.ple.formats.int8 import dequantize_rows, quantize_rows
from qwen4_exp_hcu.ple.formats.int8_scheme import ple_int8_scheme, ple_quantization_config
from qwen4_exp_hcu.quantize import INDEX, is_ple_table, main

PLE = "model.layers.0.ple.ple_embedding.ngram_embedding"
SPLIT = 3  # 4096 table rows -> uneven shards (1366, 1366, 1364)


def tiny_config() -> transformers.Qwen4ExpTextConfig:
    return transformers.Qwen4ExpTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, layer_types=["linear_attention", "indexed_attention"], linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
        ple_layer_ids=[1], heads_per_ngram=2, ngram_vocab_size_base=1000, split_ngram_parts=SPLIT, eos_token_id=1,
        max_position_embeddings=128, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=64,
        indexer_compress_ratio=4,
    )  # fmt: skip


def save_tiny(path: Path, max_shard_size: str) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen4ExpForCausalLM(tiny_config()).to(torch.bfloat16)
    table = model.model.layers[0].ple.ple_embedding.ngram_embedding.weight
    with torch.no_grad():
        table[:7] = 0  # all-zero rows
        table[7:9] *= 1e4  # rows of very different magnitude
        table[9:11] *= 1e-30
    model.save_pretrained(path, max_shard_size=max_shard_size)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "training_args.bin").write_bytes(b"not copied")
    return path


@pytest.fixture(scope="module")
def sharded_src(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("src_sharded"), "200KB")


@pytest.fixture(scope="module")
def single_src(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("src_single"), "50GB")


def read_all(folder: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """tensor name -> (file name, tensor) over every safetensors file of a checkpoint."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: (file.name, f.get_tensor(k)) for k in f.keys()})
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def shard_names(tensors) -> list[str]:
    return sorted((n for n in tensors if is_ple_table(n)), key=lambda n: int(n.split(".")[-2].removeprefix("shard_")))


@pytest.fixture(scope="module", params=["sharded", "single"])
def converted(request, tmp_path_factory):
    src = request.getfixturevalue(f"{request.param}_src")
    dst = tmp_path_factory.mktemp("dst") / "int8"
    main([str(src), str(dst)])
    return src, dst


def test_other_tensors_untouched_and_layout_kept(converted):
    src, dst = converted
    before, after = read_all(src), read_all(dst)
    shards = shard_names(before)
    assert [n.rsplit(".", 2)[-2] for n in shards] == [f"shard_{j}" for j in range(SPLIT)]
    assert sorted(os.listdir(src)) == sorted(set(os.listdir(dst)) | {"training_args.bin"})
    scale_names = {n.replace(".weight", ".weight_scale") for n in shards}
    assert set(after) == set(before) | scale_names
    for name, (file, tensor) in before.items():
        out_file, out = after[name]
        assert out_file == file, f"{name} moved from {file} to {out_file}"
        if name in shards:
            scale_file, scale = after[name.replace(".weight", ".weight_scale")]
            q_ref, scale_ref = quantize_rows(tensor)
            assert scale_file == file
            assert out.dtype == torch.int8 and out.shape == tensor.shape and torch.equal(out, q_ref)
            assert scale.dtype == torch.bfloat16 and scale.shape == (tensor.shape[0], 1)
            assert torch.equal(scale, scale_ref)
        else:
            assert out.dtype == tensor.dtype and out.shape == tensor.shape and raw(out) == raw(tensor), name
    for file in dst.glob("*.safetensors"):
        with safe_open(src / file.name, framework="pt") as a, safe_open(file, framework="pt") as b:
            assert a.metadata() == b.metadata()


def test_config_and_side_files(converted):
    src, dst = converted
    before = json.loads((src / "config.json").read_text())
    after = json.loads((dst / "config.json").read_text())
    assert after.pop("quantization_config") == ple_quantization_config()
    assert after == before
    assert ple_int8_scheme(json.loads((dst / "config.json").read_text())["quantization_config"])
    assert (dst / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert not (dst / "training_args.bin").exists()
    assert not list(dst.parent.glob(".int8.partial-*"))
    if (src / INDEX).exists():
        index = json.loads((dst / INDEX).read_text())
        tensors = read_all(dst)
        assert index["weight_map"] == {name: file for name, (file, _) in tensors.items()}
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in tensors.values())
    else:
        assert not (dst / INDEX).exists()


def test_compressed_tensors_decompressor_round_trip(converted):
    """compressed-tensors' model-free path: its target matching + the compressor its format names."""
    src, dst = converted
    qconfig = QuantizationConfig.model_validate(json.loads((dst / "config.json").read_text())["quantization_config"])
    tensors = {name: t for name, (_, t) in read_all(dst).items()}
    decompressed = {}
    for scheme in qconfig.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        params = compressor.compression_param_names(scheme)
        assert params == ("weight", "weight_scale")
        for module, _ in match_quantizable_tensors(tensors, qconfig.ignore, scheme.targets, param_targets=[params[0]]):
            state = {p: tensors[f"{module}.{p}"] for p in params}
            decompressed[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"]
    originals = {name: t for name, (_, t) in read_all(src).items() if is_ple_table(name)}
    assert decompressed.keys() == originals.keys()
    for name, original in originals.items():
        expected = dequantize_rows(*quantize_rows(original))
        assert decompressed[name].dtype == torch.bfloat16
        assert torch.equal(decompressed[name].view(torch.int16), expected.view(torch.int16)), name


def test_transformers_compressed_tensors_loader_round_trip(converted):
    """transformers' CompressedTensors loader: shards concatenated, then decompressed by compressed-tensors."""
    src, dst = converted
    model = transformers.AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=transformers.CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    )
    table = model.model.layers[0].ple.ple_embedding.ngram_embedding.weight
    originals = read_all(src)
    expected = torch.cat([dequantize_rows(*quantize_rows(originals[n][1])) for n in shard_names(originals)])
    assert table.dtype == torch.bfloat16
    assert torch.equal(table.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(expected, torch.cat([originals[n][1] for n in shard_names(originals)]))  # it is lossy


def test_refuses_non_empty_dst(sharded_src, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        main([str(sharded_src), str(tmp_path)])
    assert e.value.code == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_empty_dst_folder_is_accepted(sharded_src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    main([str(sharded_src), str(dst)])
    assert (dst / "config.json").exists()


def test_refuses_already_quantized(converted, tmp_path, capsys):
    _, dst = converted
    with pytest.raises(SystemExit):
        main([str(dst), str(tmp_path / "again")])
    assert "already quantizes the PLE tables" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def fake_checkpoint(path: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """`tensors` in one file, with the tiny model's config (+ `config`) and a tokenizer."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**tiny_config().to_dict(), **config}))
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize(
    "tensors, message",
    [
        ({f"{PLE}.shard_0.weight": torch.tensor([[1.0, float("nan")]], dtype=torch.bfloat16)},
         rf"{PLE}\.shard_0\.weight: PLE table has non-finite"),
        ({f"{PLE}.shard_0.weight": torch.zeros(2, 4, dtype=torch.int8)}, r"already quantized"),
        ({f"{PLE}.shard_0.weight_scale": torch.ones(2, 1, dtype=torch.bfloat16)}, r"already holds quantized"),
        ({"model.embed_tokens.weight": torch.zeros(2, 4)}, r"no PLE tables"),
    ],
)  # fmt: skip
def test_refuses_bad_sources_and_leaves_nothing(tmp_path, capsys, tensors, message):
    src = fake_checkpoint(tmp_path / "src", tensors)
    with pytest.raises(SystemExit):
        main([str(src), str(tmp_path / "dst")])
    assert re.search(message, capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no DST, no partial folder


def test_missing_source_files(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere"), str(tmp_path / "dst")])
    assert "has no config.json" in capsys.readouterr().err
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"a.weight": "model-1.safetensors"}}))
    with pytest.raises(SystemExit):
        main([str(src), str(tmp_path / "dst")])
    assert "missing from SRC" in capsys.readouterr().err


W8A8_GROUP = {
    "targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
}


def test_main_model_quantization_config_is_kept_and_merged(tmp_path):
    """A compressed-tensors main model keeps its groups, ignore list and format; the PLE group is added."""
    main_config = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": W8A8_GROUP},
                   "ignore": ["lm_head", "model.layers.0.ple.key_proj"], "quantization_status": "compressed"}  # fmt: skip
    src = fake_checkpoint(tmp_path / "src", {f"{PLE}.shard_0.weight": torch.ones(2, 4, dtype=torch.bfloat16)},
                          quantization_config=main_config)
    main([str(src), str(tmp_path / "dst")])
    written = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert written == {**main_config, "config_groups": {"group_0": W8A8_GROUP, **ple_quantization_config()["config_groups"]}}
    assert ple_int8_scheme(written)


def test_other_main_methods_keep_their_config_and_gain_a_ple_entry(tmp_path):
    """`quant_method: fp8` (or any non-compressed-tensors method) stays as it is; the PLE tables are
    declared under `ple_tables` beside it, and, for `fp8`, listed as not converted (upstream reads an FP8
    checkpoint's table as FP8 unless `modules_to_not_convert` names it)."""
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    src = fake_checkpoint(tmp_path / "src", {f"{PLE}.shard_0.weight": torch.ones(2, 4, dtype=torch.bfloat16)},
                          quantization_config=fp8)
    main([str(src), str(tmp_path / "dst")])
    written = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert written == {**fp8, "modules_to_not_convert": [PLE], "ple_tables": ple_quantization_config()}


# ModelOpt <= 0.29 writes its config only to hf_quant_config.json (vLLM reads it when config.json has none)
MODELOPT_LEGACY = {"producer": {"name": "modelopt", "version": "0.29.0"},
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}  # fmt: skip


def test_modelopt_config_beside_config_json_is_carried_into_it(tmp_path):
    """Writing a quantization_config would hide hf_quant_config.json from vLLM: its content goes in too."""
    src = fake_checkpoint(tmp_path / "src", {f"{PLE}.shard_0.weight": torch.ones(2, 4, dtype=torch.bfloat16)})
    (src / "hf_quant_config.json").write_text(json.dumps(MODELOPT_LEGACY))
    main([str(src), str(tmp_path / "dst")])
    written = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"]
    assert written == {**MODELOPT_LEGACY, "ple_tables": ple_quantization_config()}
    assert json.loads((tmp_path / "dst" / "hf_quant_config.json").read_text()) == MODELOPT_LEGACY


def test_refuses_a_checkpoint_whose_tables_are_already_declared(tmp_path, capsys):
    src = fake_checkpoint(tmp_path / "src", {f"{PLE}.shard_0.weight": torch.ones(2, 4, dtype=torch.bfloat16)},
                          quantization_config=ple_quantization_config())
    with pytest.raises(SystemExit):
        main([str(src), str(tmp_path / "dst")])
    assert "already quantizes the PLE tables" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_upstream_fp8_and_nvfp4_tables_become_int8(tmp_path, fmt):
    """Upstream-layout FP8/NVFP4 tables are dequantized and re-quantized to INT8 rows: the same as
    quantizing their dequantized BF16 rows; their scales and `ple_embedding_dtype` are gone."""
    from helpers.checkpoints import upstream_table_checkpoints

    from qwen4_exp_hcu.tiny import make_tiny_checkpoint

    src = upstream_table_checkpoints(make_tiny_checkpoint(tmp_path / "bf16"), tmp_path / fmt, tmp_path / "deq", fmt)
    main([str(src), str(tmp_path / "int8")])
    main([str(tmp_path / "deq"), str(tmp_path / "int8-from-deq")])
    got, want = (load_file(tmp_path / d / "model.safetensors") for d in ("int8", "int8-from-deq"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert "ple_embedding_dtype" not in json.loads((tmp_path / "int8" / "config.json").read_text())


def test_nvfp4_output_is_upstreams_layout(tmp_path):
    """`--format nvfp4`: packed e2m1 rows, e4m3 block scales and ONE fp32 `...ngram_embedding.weight_scale_2`
    per table (from the table's largest value); no quantization config is added, the text config
    declares `ple_embedding_dtype: nvfp4`; the rows dequantize to what `quantize_nvfp4_rows` gives and
    stay within NVFP4's error of the source."""
    from qwen4_exp_hcu.ple.formats.rows import dequantize_nvfp4_rows, nvfp4_tensor_scale, quantize_nvfp4_rows
    from qwen4_exp_hcu.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "bf16")
    main([str(src), str(tmp_path / "nvfp4"), "--format", "nvfp4"])
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "nvfp4" / "model.safetensors")
    config = json.loads((tmp_path / "nvfp4" / "config.json").read_text())
    assert config["ple_embedding_dtype"] == "nvfp4" and "quantization_config" not in config
    tables = {}
    for name in (k for k in before if k.endswith(".weight") and ".ngram_embedding.shard_" in k):
        tables.setdefault(name.rsplit(".shard_", 1)[0], []).append(name)
    for table, shards in tables.items():
        scale = nvfp4_tensor_scale(max(before[n].float().abs().max().item() for n in shards))
        assert torch.equal(after[table + ".weight_scale_2"], scale)
        for name in shards:
            packed, block = quantize_nvfp4_rows(before[name], scale)
            assert after[name].dtype == torch.uint8 and torch.equal(after[name], packed)
            assert torch.equal(after[name + "_scale"].view(torch.uint8), block.view(torch.uint8))
            assert name + "_scale_2" not in after  # one scale per table, upstream's layout
            rows = dequantize_nvfp4_rows(after[name], after[name + "_scale"], after[table + ".weight_scale_2"]).float()
            err = (rows - before[name].float()).abs().mean() / before[name].float().abs().mean()
            assert err < 0.15, err
    others = [k for k in before if ".ngram_embedding." not in k]
    assert all(torch.equal(before[k], after[k]) for k in others)


def fp8_release_source(tmp_path: Path, scale: dict) -> Path:
    """A PLE table as Qwen's FP8 release stores and declares it: e4m3 shards, `scale` (the table-level
    `weight_scale` and/or old per-shard copies), `quant_method: fp8` naming it in `modules_to_convert`."""
    rows = torch.tensor([[1.0, -2.0, 0.5, 448.0] * 4, [0.0, 3.0, -0.25, 8.0] * 4]).to(torch.float8_e4m3fn)
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_convert": ["ple.ple_embedding.ngram_embedding"],
           "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    tensors = {f"{PLE}.shard_0.weight": rows, f"{PLE}.shard_1.weight": rows[:1].clone(), **scale}
    return fake_checkpoint(tmp_path / "src", tensors, quantization_config=fp8)


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_fp8_release_tables_are_converted_and_redeclared(tmp_path, fmt):
    """The release's one bf16 table scale dequantizes every shard (upstream's bf16 arithmetic); the FP8
    declaration is taken back (`modules_to_not_convert`) and the written format declared instead."""
    from qwen4_exp_hcu.ple.formats.declaration import declared_table_format

    scale = torch.tensor([0.0625], dtype=torch.bfloat16)
    src = fp8_release_source(tmp_path, {f"{PLE}.weight_scale": scale})
    main([str(src), str(tmp_path / "dst"), "--format", fmt])
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    after, before = load_file(tmp_path / "dst" / "model.safetensors"), load_file(src / "model.safetensors")
    assert config["quantization_config"]["modules_to_convert"] == []
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head", PLE]
    text = type("Text", (), {"ple_embedding_dtype": config.get("ple_embedding_dtype")})()
    assert declared_table_format(text, config["quantization_config"], [PLE]) == fmt
    assert f"{PLE}.weight_scale" not in after
    if fmt == "int8":
        q, s = quantize_rows(before[f"{PLE}.shard_0.weight"].to(torch.bfloat16) * scale)
        assert torch.equal(after[f"{PLE}.shard_0.weight"], q) and torch.equal(after[f"{PLE}.shard_0.weight_scale"], s)
    else:
        from qwen4_exp_hcu.ple.formats.rows import nvfp4_tensor_scale, quantize_nvfp4_rows

        rows = [before[f"{PLE}.shard_{j}.weight"].to(torch.bfloat16) * scale for j in (0, 1)]
        table_scale = nvfp4_tensor_scale(max(r.float().abs().max().item() for r in rows))
        assert torch.equal(after[f"{PLE}.weight_scale_2"], table_scale)
        for j, r in enumerate(rows):
            packed, block = quantize_nvfp4_rows(r, table_scale)
            assert torch.equal(after[f"{PLE}.shard_{j}.weight"], packed)
            assert torch.equal(after[f"{PLE}.shard_{j}.weight_scale"].view(torch.uint8), block.view(torch.uint8))


@pytest.mark.parametrize(
    "scale, message",
    [
        ({}, rf"{PLE}\.weight_scale: missing, the one scale of the F8_E4M3 PLE table"),
        ({f"{PLE}.shard_0.weight_scale": torch.ones(1), f"{PLE}.shard_1.weight_scale": torch.ones(1)},
         rf"{PLE}\.shard_0\.weight_scale: an earlier qwen4_exp_hcu layout .* quantize from the BF16 checkpoint"),
    ],
    ids=["no table scale", "old per-shard scales"],
)  # fmt: skip
def test_fp8_sources_without_the_table_scale_are_refused(tmp_path, capsys, scale, message):
    src = fp8_release_source(tmp_path, scale)
    with pytest.raises(SystemExit):
        main([str(src), str(tmp_path / "dst")])
    assert re.search(message, capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def _config(**changes):
    def edit(src):
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _multimodal(**text_changes):
    """The tiny text config nested as a multimodal checkpoint's `text_config`, with `text_changes`."""
    config = {"model_type": "qwen4_exp", "text_config": {**tiny_config().to_dict(), **text_changes}}
    return lambda src: (src / "config.json").write_text(json.dumps(config))


def _truncate(src: Path) -> None:
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) - 4])


def _table(tensor):
    return lambda src: save_file({f"{PLE}.shard_0.weight": tensor}, src / "model.safetensors")


@pytest.mark.parametrize(
    "edit, message",
    [
        (_config(ple_layer_ids=[3]), r"config\.json: ple_layer_ids: 3 is not a layer in 1\.\.num_hidden_layers \(2\)"),
        (_multimodal(ple_layer_ids=[2]),
         r"config\.json: ple_layer_ids: layer 2 is 'indexed_attention' in layer_types; PLE layers must be linear_attention"),
        (_config(hc_count=1), r"config\.json: transformers rejects it: .*hc_count > 1"),
        (_truncate, r"model\.safetensors: unreadable safetensors file \(.*incomplete metadata"),
        (lambda src: (src / INDEX).write_text("{"), rf"{INDEX}: not valid JSON"),
        (_table(torch.ones(2, 4, dtype=torch.float64)), rf"{PLE}\.shard_0\.weight: PLE table dtype F64 is not a source"),
        (_table(torch.ones(2, 4, 1, dtype=torch.bfloat16)), rf"{PLE}\.shard_0\.weight: expected a 2-D PLE table shard"),
    ],
    ids=["ple layer out of range", "ple layer not linear", "transformers rejects", "truncated file", "index not json",
         "table dtype", "table shape"],
)  # fmt: skip
def test_bad_inputs_are_one_line_errors_before_anything_is_written(tmp_path, capsys, edit, message):
    """Checked before the output folder exists: the config as transformers reads it, every file's header, the
    tables' dtypes and shapes. One line naming the file, setting or tensor; nothing written."""
    src = fake_checkpoint(tmp_path / "src", {f"{PLE}.shard_0.weight": torch.ones(2, 4, dtype=torch.bfloat16)})
    edit(src)
    with pytest.raises(SystemExit) as e:
        main([str(src), str(tmp_path / "dst")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(message, err) and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_float16_tables_are_quantized_from_their_exact_float32_values(tmp_path):
    table = torch.randn(3, 8).to(torch.float16)
    src = fake_checkpoint(tmp_path / "src", {f"{PLE}.shard_0.weight": table})
    main([str(src), str(tmp_path / "dst")])
    written = load_file(tmp_path / "dst" / "model.safetensors")
    q, scale = quantize_rows(table.float())
    assert torch.equal(written[f"{PLE}.shard_0.weight"], q)
    assert torch.equal(written[f"{PLE}.shard_0.weight_scale"], scale)


def test_missing_tokenizer_is_a_warning_and_a_summary_ends_the_run(tmp_path, capsys):
    tensors = {f"{PLE}.shard_0.weight": torch.ones(2, 4, dtype=torch.bfloat16), "model.norm.weight": torch.ones(64)}
    src = fake_checkpoint(tmp_path / "src", tensors)
    (src / "tokenizer.json").unlink()
    main([str(src), str(tmp_path / "dst")])
    out, err = capsys.readouterr()
    assert re.search(r"quantize: warning: .*src has no tokenizer \(none of tokenizer\.json, .*\); serving DST", err)
    # bf16 [2, 4] = 16 B -> int8 [2, 4] + bf16 scales [2, 1] = 12 B; the norm is copied, not counted
    assert re.fullmatch(r"quantize: PLE tables 1, rows 2, bytes 16 -> 12, \d+\.\d s \(int8\) -> .*dst\n", out), out


def test_help_imports_neither_torch_nor_transformers():
    """`--help` answers at once: the heavy modules are imported by the functions that convert."""
    heavy = ("torch", "transformers", "safetensors", "compressed_tensors")
    code = (f"import sys\nfrom qwen4_exp_hcu.quantize import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
            f"    pass\nprint([m for m in {heavy} if m in sys.modules])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: python -m qwen4_exp_hcu.quantize" in out and out.strip().endswith("[]")
