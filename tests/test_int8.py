"""INT8 PLE row format: bit-exact against compressed-tensors, validation, and config parsing."""

import copy
import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils.match import match_name
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen4_exp_hcu.names import TABLE_TARGET as PLE_TARGET
from qwen4_exp_hcu.ple.formats.int8 import dequantize_rows, quantize_rows, validate_int8_weight, validate_scale
from qwen4_exp_hcu.ple.formats.int8_scheme import ple_int8_scheme, ple_quantization_config

SHARD = "model.layers.3.ple.ple_embedding.ngram_embedding.shard_0"
# What the written config declares; HCU configs omit scale_dtype, which gives the same numbers for BF16 tables.
WRITTEN_ARGS = QuantizationConfig.model_validate(ple_quantization_config()).config_groups["ple_int8"].weights
PLAIN_ARGS = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")


def ct_reference(w: torch.Tensor, args: QuantizationArgs = WRITTEN_ARGS) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own channel quantization: min/max observer -> calculate_qparams -> quantize."""
    scale, zero_point = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
    q = ct_quantize(w, scale, zero_point, args, dtype=torch.int8)
    assert torch.equal(scale.to(torch.bfloat16).to(scale.dtype), scale), "stored scale must be exactly bf16"
    return q, scale.to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit equality: also tells -0.0 from 0.0 and compares NaN payloads."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


@st.composite
def tables(draw, dtypes=(torch.bfloat16, torch.float32)):
    """Random rows of wildly different magnitudes (subnormal to near-max), some all-zero or one-hot."""
    rows = draw(st.integers(0, 12))
    dim = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(rows, dim, generator=g).clamp(-4, 4)
    exps = torch.tensor(draw(st.lists(st.integers(-140, 125), min_size=rows, max_size=rows)), dtype=torch.float64)
    w = (w.double() * torch.pow(2.0, exps).unsqueeze(1)).to(dtype)
    kinds = draw(st.lists(st.sampled_from(["random", "zero", "onehot", "neg_onehot"]), min_size=rows, max_size=rows))
    for i, kind in enumerate(kinds):
        if kind != "random":
            w[i] = 0
        if kind in ("onehot", "neg_onehot"):
            w[i, draw(st.integers(0, dim - 1))] = (1 if kind == "onehot" else -1) * 2.0 ** draw(st.integers(-20, 20))
    return w


@settings(max_examples=300, deadline=None)
@given(tables())
def test_quantize_matches_compressed_tensors(w):
    q, scale = quantize_rows(w)
    q_ref, scale_ref = ct_reference(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.bfloat16 and scale.shape == (w.shape[0], 1)
    assert_bits_equal(q, q_ref)
    assert_bits_equal(scale, scale_ref)


@settings(max_examples=100, deadline=None)
@given(tables(dtypes=(torch.bfloat16,)))
def test_bf16_tables_match_configs_without_scale_dtype(w):
    q, scale = quantize_rows(w)
    q_ref, scale_ref = ct_reference(w, PLAIN_ARGS)
    assert_bits_equal(q, q_ref)
    assert_bits_equal(scale, scale_ref)


@settings(max_examples=200, deadline=None)
@given(tables())
def test_dequantize_matches_compressed_tensors(w):
    q, scale = quantize_rows(w)
    out = dequantize_rows(q, scale)
    assert out.dtype == torch.bfloat16
    assert_bits_equal(out, ct_dequantize(q, scale))
    assert_bits_equal(out, (q.float() * scale.float()).to(torch.bfloat16))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(-133, 120))
def test_dequantize_full_int8_range(seed, exp):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (16, 24), generator=g, dtype=torch.int8)
    scale = (torch.rand(16, 1, generator=g) * 2.0**exp).to(torch.bfloat16)
    assert_bits_equal(dequantize_rows(q, scale), ct_dequantize(q, scale))


def test_edge_rows():
    w = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # all zero: compressed-tensors stores bf16 eps, q = 0
            [-127.5, 0.5, 0.25, 0.0],  # scale 1.0; -127.5 rounds half-to-even to -128
            [127.5, -0.5, 2.5, 0.0],  # +127.5 clamps to 127; 2.5 rounds to 2
            [3e38, -3e38, 1.0, 0.0],  # near the bf16 maximum
            [1e-39, -2e-40, 0.0, 0.0],  # subnormal: scale underflows to 0 -> eps, q = 0
        ],
        dtype=torch.bfloat16,
    )
    q, scale = quantize_rows(w)
    q_ref, scale_ref = ct_reference(w)
    assert_bits_equal(q, q_ref)
    assert_bits_equal(scale, scale_ref)
    assert q[0].eq(0).all() and scale[0].item() == torch.finfo(torch.bfloat16).eps
    assert scale[1].item() == scale[2].item() == 1.0
    assert q[1, 0].item() == -128 and q[2, 0].item() == 127 and q[2, 2].item() == 2
    assert q[4].eq(0).all()


def test_empty_shard():
    w = torch.empty(0, 16, dtype=torch.bfloat16)
    q, scale = quantize_rows(w)
    q_ref, scale_ref = ct_reference(w)
    assert_bits_equal(q, q_ref)  # int8 [0, 16] and bf16 [0, 1], as compressed-tensors has them
    assert_bits_equal(scale, scale_ref)
    assert_bits_equal(dequantize_rows(q, scale), torch.empty(0, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.zeros(4, dtype=torch.bfloat16), "2-D"),
        (torch.zeros(2, 4, dtype=torch.float16), "bfloat16 or float32"),
        (torch.tensor([[1.0, float("nan")]]), "non-finite"),
        (torch.tensor([[1.0, float("inf")]], dtype=torch.bfloat16), "non-finite"),
    ],
)
def test_quantize_rejects(w, match):
    with pytest.raises(ValueError, match=match):
        quantize_rows(w)


def test_validate_scale():
    good = torch.tensor([[0.5], [0.0]], dtype=torch.bfloat16)
    validate_scale(good, 2, "shard_0.weight_scale")  # zero is legal (all-zero rows)
    bad = {
        "dtype": good.float(),
        "shape": good.reshape(2),
        "rows": torch.zeros(3, 1, dtype=torch.bfloat16),
        "nan": torch.tensor([[float("nan")], [1.0]], dtype=torch.bfloat16),
        "inf": torch.tensor([[float("inf")], [1.0]], dtype=torch.bfloat16),
        "negative": torch.tensor([[-0.5], [1.0]], dtype=torch.bfloat16),
    }
    messages = {"dtype": "dtype", "shape": "shape", "rows": "shape", "nan": "non-finite", "inf": "non-finite",
                "negative": "negative"}  # fmt: skip
    for case, scale in bad.items():
        with pytest.raises(ValueError, match=rf"my\.scale.*{messages[case]}"):
            validate_scale(scale, 2, "my.scale")


def test_validate_int8_weight():
    validate_int8_weight(torch.zeros(3, 8, dtype=torch.int8), 3, 8, "w")
    with pytest.raises(ValueError, match="tbl.*dtype"):
        validate_int8_weight(torch.zeros(3, 8, dtype=torch.bfloat16), 3, 8, "tbl")
    with pytest.raises(ValueError, match=r"tbl.*shape must be \[3, 8\]"):
        validate_int8_weight(torch.zeros(3, 4, dtype=torch.int8), 3, 8, "tbl")


# ---------------------------------------------------------------- quantization_config parsing


def test_written_config():
    cfg = ple_quantization_config()
    json.dumps(cfg)  # goes into config.json as is
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    assert cfg["quantization_status"] == "compressed"
    (group,) = cfg["config_groups"].values()
    assert group["targets"] == [PLE_TARGET] and group["format"] == "int-quantized"
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"]) == (8, "int", True, "channel")
    assert group["input_activations"] is None and group["output_activations"] is None
    assert ple_int8_scheme(cfg)


@pytest.mark.parametrize(
    "name, hit",
    [
        (SHARD, True),
        ("model.layers.0.ple.ple_embedding.ngram_embedding", True),
        ("model.language_model.layers.7.ple.ple_embedding.ngram_embedding.shard_511", True),
        ("model.layers.0.ple.ple_embedding", False),
        ("model.layers.0.ple.key_proj", False),
        ("model.layers.0.ple.value_proj", False),
        ("model.embed_tokens", False),
        ("lm_head", False),
        ("model.layers.1.mlp.experts.0.up_proj", False),
    ],
)
def test_target_covers_only_ple_tables(name, hit):
    assert match_name(name, PLE_TARGET) is hit


def _config(weights=None, targets=(PLE_TARGET,), ignore=(), fmt="int-quantized", **group):
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", **(weights or {})}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"g0": {"targets": list(targets), "weights": weights, **group}},
        "ignore": list(ignore),
    }


LINEAR_W8A8 = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {"W8A8": ["Linear"]},
    "ignore": ["lm_head"],
}


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (None, False),
        ({}, False),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, False),
        (LINEAR_W8A8, False),
        (_config(), True),
        (_config(weights={"scale_dtype": "bfloat16"}), True),
        (_config(weights={"group_size": -1, "strategy": None}), True),
        (_config(fmt="naive-quantized"), True),
        (_config(fmt="mixed-precision", format="int-quantized"), True),
        (_config(targets=[SHARD]), True),
        (_config(targets=[r"re:model\.layers\.(1|5)\.ple\.ple_embedding\.ngram_embedding\..*"]), True),
        (_config(targets=["Embedding"], ignore=["model.embed_tokens"]), True),  # transformers' table is an Embedding
        (_config(targets=["Linear"]), False),
        (_config(ignore=[r"re:.*ngram_embedding.*"]), False),
        ({**_config(), "config_groups": {**_config()["config_groups"], **LINEAR_W8A8["config_groups"]}}, True),
    ],
)
def test_ple_int8_scheme(cfg, expected):
    assert ple_int8_scheme(copy.deepcopy(cfg)) is expected


@pytest.mark.parametrize(
    "cfg, match",
    [
        (_config(weights={"num_bits": 4}), "g0.*num_bits=4"),
        (_config(weights={"symmetric": False}), "g0.*symmetric=False"),
        (_config(weights={"strategy": "group", "group_size": 32}), "g0.*strategy='group'"),
        (_config(weights={"strategy": "tensor"}), "g0.*strategy='tensor'"),
        (_config(weights={"type": "float"}, fmt="float-quantized"), "g0.*format 'float-quantized'"),
        (_config(weights={"type": "float"}), "g0.*type='float'"),
        (_config(weights={"actorder": "weight"}), "g0.*actorder"),
        (_config(weights={"scale_dtype": "float16"}), "g0.*scale_dtype"),
        (_config(fmt="pack-quantized"), "g0.*format 'pack-quantized'"),
        (_config(fmt="dense"), "g0.*format 'dense'"),
        (
            _config(input_activations={"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                       "dynamic": True}),  # fmt: skip
            "g0.*input_activations",
        ),
        ({"quant_method": "compressed-tensors", "format": "int-quantized",
          "config_groups": {"g0": {"targets": [SHARD]}}}, "g0.*no weights"),  # fmt: skip
        (
            {"quant_method": "compressed-tensors", "format": "int-quantized",
             "config_groups": {"W8A16": [PLE_TARGET]}},  # fmt: skip
            "W8A16.*strategy='group'",  # a preset, expanded by compressed-tensors itself
        ),
        ({"quant_method": "compressed-tensors", "config_groups": "nope"}, "not a valid compressed-tensors"),
    ],
)
def test_ple_int8_scheme_rejects(cfg, match):
    with pytest.raises(ValueError, match=match):
        ple_int8_scheme(cfg)


def test_ple_int8_scheme_with_model_names():
    names = [f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_{j}" for i in (1, 300) for j in range(3)]
    assert ple_int8_scheme(_config(), names)
    assert not ple_int8_scheme(_config(targets=["Linear"]), names)
    # a layer beyond the built-in sample is still found when the model names its tables
    layer_300 = _config(targets=[r"re:model\.layers\.300\..*ngram_embedding.*"])
    assert not ple_int8_scheme(layer_300)
    with pytest.raises(ValueError, match="only some PLE tables.*layers.1.ple"):
        ple_int8_scheme(layer_300, names)
