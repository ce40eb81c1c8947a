"""FP8 and NVFP4 row formats (`ple.formats`): the references against the float8 dtype torch ships and the
NVFP4 definition, written out by hand."""

import torch

from qwen4_exp_hcu.ple.formats import dequantize_fp8_rows, dequantize_nvfp4_rows, table_format, unpack_e2m1


def test_e2m1_codes_low_nibble_first():
    packed = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)  # codes 1, 2 | 7, 15
    assert unpack_e2m1(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]


def test_nvfp4_rows_scale_by_block_then_tensor():
    packed = torch.full((1, 16), 0x32, dtype=torch.uint8)  # 32 values: 1.0, 1.5 alternating
    block = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)  # first 16 values x2, next 16 x0.5
    got = dequantize_nvfp4_rows(packed, block, torch.tensor(3.0))
    values = torch.tensor([1.0, 1.5] * 8)
    want = torch.cat([values * 2.0 * 3.0, values * 0.5 * 3.0])
    assert torch.equal(got, want.to(torch.bfloat16)[None])


def test_fp8_rows_one_tensor_scale():
    w = torch.tensor([[0.5, -448.0, 0.001953125]]).to(torch.float8_e4m3fn)
    assert dequantize_fp8_rows(w, torch.tensor([2.0])).tolist() == [[1.0, -896.0, 0.00390625]]


def test_format_from_dtypes():
    u8, e4 = torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.float8_e4m3fn)
    assert table_format(torch.zeros(1, 2, dtype=torch.bfloat16), None) == "bf16"
    assert table_format(torch.zeros(1, 2, dtype=torch.int8), torch.zeros(1, 1, dtype=torch.bfloat16)) == "int8"
    assert table_format(torch.zeros(1, 2, dtype=torch.float8_e4m3fn), torch.ones(1)) == "fp8"
    assert table_format(u8, e4) == "nvfp4"


# ---- tables in upstream's FP8 / NVFP4 layout ---------------------------------------------------------
import pytest  # noqa: E402

from dist_utils import random_ple_state_dict  # noqa: E402
from ple_configs import tiny_text_config  # noqa: E402
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState  # noqa: E402
from qwen4_exp_hcu.ple.layer import PLELayer  # noqa: E402

SHARD = "ple_embedding.ngram_embedding.shard_{}.weight"
NVFP4_CFG = dict(ple_embed_dim=64)  # 4 heads of 16: one NVFP4 block per head


def upstream_layout(sd, fmt, seed=0):
    """`sd` with every table shard replaced by random rows in upstream's `fmt` layout, and the BF16 copy of
    the same rows (their dequantized values): (quantized state dict, bf16 state dict)."""
    g = torch.Generator().manual_seed(seed)
    quantized, bf16 = dict(sd), dict(sd)
    for j in range(len([k for k in sd if k.endswith(".weight") and ".shard_" in k])):
        rows, d = sd[SHARD.format(j)].shape
        name = SHARD.format(j)
        if fmt == "fp8":
            w = (torch.randn(rows, d, generator=g) * 50).to(torch.float8_e4m3fn)
            scale = torch.tensor([0.03125])  # one table scale, repeated in every shard
            quantized[name], quantized[name + "_scale"] = w, scale
            bf16[name] = dequantize_fp8_rows(w, scale)
        else:
            packed = torch.randint(0, 256, (rows, d // 2), generator=g, dtype=torch.int32).to(torch.uint8)
            block = (torch.rand(rows, d // 16, generator=g) * 4 + 0.1).to(torch.float8_e4m3fn)
            scale_2 = torch.tensor([0.25])
            quantized[name], quantized[name + "_scale"], quantized[name + "_scale_2"] = packed, block, scale_2
            bf16[name] = dequantize_nvfp4_rows(packed, block, scale_2)
    return quantized, bf16


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_upstream_tables_load_and_equal_their_dequantized_rows(fmt):
    """A layer holding the table as `fmt` looks up and computes exactly what a BF16 layer holding the
    dequantized rows does; the storage keeps the checkpoint's bytes (no conversion on load)."""
    cfg = tiny_text_config(**NVFP4_CFG)
    quantized, bf16 = upstream_layout(random_ple_state_dict(cfg, 1, False, seed=3), fmt)
    ours = PLELayer.from_state_dict(cfg, 1, quantized, table_format=fmt, dtype=torch.float32)
    ref = PLELayer.from_state_dict(cfg, 1, bf16, table_format="bf16", dtype=torch.float32)
    assert ours.table.weight.dtype == {"fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[fmt]
    assert ours.table.nbytes < ref.table.nbytes / (1.9 if fmt == "fp8" else 3.5)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    batch = PLEBatch.from_lengths(ids, [7, 4], [0, 2], [False, False])
    hs = torch.randn(11, cfg.hidden_size * cfg.hc_count, generator=torch.Generator().manual_seed(2))
    states = [PLEState.zeros(ours.state_shapes(), 3, torch.float32) for _ in range(2)]
    assert torch.equal(ours.lookup(batch, states[0]), ref.lookup(batch, states[1]))
    assert torch.equal(ours(hs, batch, states[0]), ref(hs, batch, states[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("host", [False, True], ids=["device", "pinned_host"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_gpu_upstream_tables_look_up_exactly(fmt, host):
    """The fused kernel on the accelerator, table on it or in pinned host memory: equal to the CPU layer
    holding the dequantized rows."""
    cfg = tiny_text_config(**NVFP4_CFG)
    quantized, bf16 = upstream_layout(random_ple_state_dict(cfg, 1, False, seed=3), fmt)
    ours = PLELayer.from_state_dict(cfg, 1, quantized, table_format=fmt, device="cuda", host_table=host, dtype=torch.float32)
    ref = PLELayer.from_state_dict(cfg, 1, bf16, table_format="bf16", dtype=torch.float32)
    assert ours.table.weight.is_pinned() == host
    ids = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    batch = PLEBatch.from_lengths(ids, [200, 100], [0, 2], [False, False])
    state = PLEState.zeros(ref.state_shapes(), 3, torch.float32)
    want = ref.lookup(batch, state)
    got = ours.lookup(PLEBatch.from_lengths(ids.cuda(), [200, 100], [0, 2], [False, False]), PLEState.zeros(ref.state_shapes(), 3, torch.float32, "cuda"))
    assert torch.equal(got.cpu(), want)


def test_upstream_table_errors_name_the_tensor():
    cfg = tiny_text_config(**NVFP4_CFG)
    quantized, _ = upstream_layout(random_ple_state_dict(cfg, 1, False, seed=3), "nvfp4")
    prefix = "model.layers.2.ple."
    missing = {k: v for k, v in quantized.items() if k != SHARD.format(1) + "_scale_2"}
    with pytest.raises(ValueError, match=r"shard_1\.weight_scale_2 is missing"):
        PLELayer.from_state_dict(cfg, 1, {prefix + k: v for k, v in missing.items()}, prefix, table_format="nvfp4")
    other = dict(quantized, **{SHARD.format(2) + "_scale_2": torch.tensor([0.5])})
    with pytest.raises(ValueError, match=r"shard_2\.weight_scale_2: 0\.5 differs from the table scale 0\.25"):
        PLELayer.from_state_dict(cfg, 1, other, table_format="nvfp4")
    with pytest.raises(ValueError, match=r"shard_0\.weight: a nvfp4 shard cannot be stored as a int8 table"):
        PLELayer.from_state_dict(cfg, 1, quantized, table_format="int8")
