"""How checkpoints declare their PLE tables' format (`ple.declaration`), on the releases' own configs (the
census of their config.json files) and on each other way: `ple_embedding_dtype`, our INT8 group, conflicts."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from qwen4_exp_hcu.ple.formats.declaration import declared_table_format, without_fp8_declarations
from qwen4_exp_hcu.ple.formats.int8_scheme import merge_ple_group

# a copy of ../shared/official-checkpoint/census.json (public header inventories; see data/census_README.md)
CENSUS = json.loads((Path(__file__).resolve().parent / "data/census.json").read_text())
TABLES = ["model.layers.1.ple.ple_embedding.ngram_embedding"]  # the runtime name (text model)
RELEASE_TABLE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"  # the checkpoint's name
TEXT = SimpleNamespace()  # a text config without `ple_embedding_dtype`, as every release's


def nvidia_quantization() -> dict:
    """NVIDIA's NVFP4 release as the census gives its `quantized_layers` (keys exactly, l in 0..47)."""
    layers = {f"model.language_model.layers.{i}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in range(48)}
    layers["mtp.layers.0.mlp.experts"] = {"quant_algo": "FP8_PB_WO", "group_size": 128}
    layers[RELEASE_TABLE] = {"quant_algo": "FP8"}
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": layers}


def test_releases_as_they_declare_their_tables():
    bf16 = CENSUS["config"]["bf16_config_json"]
    fp8 = CENSUS["config"]["fp8_config_json"]["quantization_config"]
    assert "ple_embedding_dtype" not in bf16["text_config"] and "quantization_config" not in bf16
    assert declared_table_format(TEXT, None, TABLES) == "bf16"
    assert declared_table_format(TEXT, fp8, TABLES) == "fp8"  # modules_to_convert: ["ple.ple_embedding.ngram_embedding"]
    assert declared_table_format(TEXT, nvidia_quantization(), TABLES) == "fp8"


def test_fp8_method_follows_upstreams_rule():
    """`quant_method: fp8`: the table is FP8 unless `modules_to_not_convert` lists it (multimodal names
    included); a `modules_to_convert` list that leaves the table out is a contradiction."""
    plain = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert declared_table_format(TEXT, plain, TABLES) == "fp8"
    assert declared_table_format(TEXT, {**plain, "modules_to_not_convert": [RELEASE_TABLE]}, TABLES) == "bf16"
    with pytest.raises(ValueError, match=r"modules_to_convert \['mlp.experts'\] does not name the PLE table"):
        declared_table_format(TEXT, {**plain, "modules_to_convert": ["mlp.experts"]}, TABLES)
    with pytest.raises(ValueError, match="both in modules_to_convert and modules_to_not_convert"):
        declared_table_format(TEXT, {**plain, "modules_to_convert": ["ngram_embedding"], "modules_to_not_convert": ["ple"]}, TABLES)


def test_upstream_dtype_field_and_conflicts():
    assert declared_table_format(SimpleNamespace(ple_embedding_dtype="float8_e4m3fn"), None, TABLES) == "fp8"
    assert declared_table_format(SimpleNamespace(ple_embedding_dtype="nvfp4"), None, TABLES) == "nvfp4"
    assert declared_table_format(SimpleNamespace(ple_embedding_dtype="float8_e4m3fn"), nvidia_quantization(), TABLES) == "fp8"
    with pytest.raises(ValueError, match="ple_embedding_dtype='int4' is not supported"):
        declared_table_format(SimpleNamespace(ple_embedding_dtype="int4"), None, TABLES)
    with pytest.raises(ValueError, match="declares its PLE tables twice, differently"):
        declared_table_format(SimpleNamespace(ple_embedding_dtype="nvfp4"), nvidia_quantization(), TABLES)
    int8 = merge_ple_group(None)
    assert declared_table_format(TEXT, int8, TABLES) == "int8"
    with pytest.raises(ValueError, match="declares its PLE tables twice, differently"):
        declared_table_format(SimpleNamespace(ple_embedding_dtype="float8_e4m3fn"), int8, TABLES)
    bad = nvidia_quantization()
    bad["quantized_layers"][RELEASE_TABLE] = {"quant_algo": "W4A16_AWQ"}
    with pytest.raises(ValueError, match=r"quant_algo 'W4A16_AWQ' is not a PLE table format"):
        declared_table_format(TEXT, bad, TABLES)


def test_quantizer_takes_the_fp8_declarations_back():
    """What the quantizer writes over a release's config: the table no longer declared FP8 by the main
    method, every other entry kept."""
    fp8 = CENSUS["config"]["fp8_config_json"]["quantization_config"]
    undone = without_fp8_declarations(fp8, [RELEASE_TABLE])
    assert undone["modules_to_convert"] == [] and undone["modules_to_not_convert"] == [*fp8["modules_to_not_convert"], RELEASE_TABLE]
    assert declared_table_format(TEXT, undone, TABLES) == "bf16"
    assert declared_table_format(TEXT, merge_ple_group(undone), TABLES) == "int8"
    nvidia = without_fp8_declarations(nvidia_quantization(), [RELEASE_TABLE])
    assert RELEASE_TABLE not in nvidia["quantized_layers"] and len(nvidia["quantized_layers"]) == 49
    assert declared_table_format(TEXT, nvidia, TABLES) == "bf16"
