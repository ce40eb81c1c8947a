"""FP8 and NVFP4 row formats (`ple.formats`): the references against the float8 dtype torch ships and the
NVFP4 definition, written out by hand."""

import torch

from qwen4_exp_hcu.ple.formats.rows import dequantize_fp8_rows, dequantize_nvfp4_rows, table_format, unpack_e2m1


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


def test_safetensors_codes_are_the_librarys():
    """`SAFETENSORS_DTYPES` (read without torch, by the quantizer) names each dtype as the safetensors library
    writes it in a file's header."""
    import json
    import struct

    from safetensors.torch import save

    from qwen4_exp_hcu.ple.formats.rows import SAFETENSORS_DTYPES

    for name, code in SAFETENSORS_DTYPES.items():
        blob = save({"t": torch.zeros(1, dtype=getattr(torch, name))})
        header = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
        assert header["t"]["dtype"] == code, name


# ---- tables in upstream's FP8 / NVFP4 layout ---------------------------------------------------------
import pytest  # noqa: E402

from helpers.configs import tiny_text_config  # noqa: E402
from helpers.layers import ple_state_dict  # noqa: E402
from helpers.oracles import fp8_rows, nvfp4_rows  # noqa: E402
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState  # noqa: E402
from qwen4_exp_hcu.ple.layer import PLELayer  # noqa: E402
from qwen4_exp_hcu.ple.storage import PLEStorage  # noqa: E402

SHARD = "ple_embedding.ngram_embedding.shard_{}.weight"
TABLE_SCALE = {"fp8": "ple_embedding.ngram_embedding.weight_scale", "nvfp4": "ple_embedding.ngram_embedding.weight_scale_2"}
NVFP4_CFG = dict(ple_embed_dim=64)  # 4 heads of 16: one NVFP4 block per head


def upstream_layout(sd, fmt, seed=0, table_scale=None):
    """`sd` with every table shard replaced by random rows in upstream's `fmt` layout (one table-level scale,
    bf16 [1] as the FP8 release stores it unless `table_scale` is given), and the BF16 copy of the same rows
    (their values decoded by torch's float8 dtype / compressed-tensors, not by `ple.formats`):
    (quantized state dict, bf16 state dict)."""
    g = torch.Generator().manual_seed(seed)
    quantized, bf16 = dict(sd), dict(sd)
    scale = table_scale if table_scale is not None else torch.tensor([0.03125 if fmt == "fp8" else 0.25], dtype=torch.bfloat16)
    quantized[TABLE_SCALE[fmt]] = scale
    for j in range(len([k for k in sd if k.endswith(".weight") and ".shard_" in k])):
        rows, d = sd[SHARD.format(j)].shape
        name = SHARD.format(j)
        if fmt == "fp8":
            w = (torch.randn(rows, d, generator=g) * 50).to(torch.float8_e4m3fn)
            quantized[name] = w
            bf16[name] = fp8_rows(w, scale)
        else:
            packed = torch.randint(0, 256, (rows, d // 2), generator=g, dtype=torch.int32).to(torch.uint8)
            block = (torch.rand(rows, d // 16, generator=g) * 4 + 0.1).to(torch.float8_e4m3fn)
            quantized[name], quantized[name + "_scale"] = packed, block
            bf16[name] = nvfp4_rows(packed, block, scale)
    return quantized, bf16


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_upstream_tables_load_and_equal_their_dequantized_rows(fmt):
    """A layer holding the table as `fmt` looks up and computes exactly what a BF16 layer holding the
    dequantized rows does; the storage keeps the checkpoint's bytes (no conversion on load)."""
    cfg = tiny_text_config(**NVFP4_CFG)
    quantized, bf16 = upstream_layout(ple_state_dict(cfg, 1, False, seed=3), fmt)
    ours = PLELayer.from_state_dict(cfg, 1, quantized, storage=PLEStorage(fmt), dtype=torch.float32)
    ref = PLELayer.from_state_dict(cfg, 1, bf16, storage=PLEStorage("bf16"), dtype=torch.float32)
    assert ours.table.weight.dtype == {"fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}[fmt]
    shards = range(len([k for k in quantized if k.endswith(".weight") and ".shard_" in k]))
    raw = lambda parts: torch.cat(parts).view(torch.uint8)  # noqa: E731
    assert torch.equal(ours.table.weight.view(torch.uint8), raw([quantized[SHARD.format(j)] for j in shards]))
    if fmt == "nvfp4":  # ... and the per-block scales, every row as the checkpoint has it
        assert torch.equal(ours.table.scale.view(torch.uint8), raw([quantized[SHARD.format(j) + "_scale"] for j in shards]))
    assert ours.table.tensor_scale.tolist() == quantized[TABLE_SCALE[fmt]].float().tolist()
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
    quantized, bf16 = upstream_layout(ple_state_dict(cfg, 1, False, seed=3), fmt)
    ours = PLELayer.from_state_dict(cfg, 1, quantized, storage=PLEStorage(fmt, "cuda", host=host), dtype=torch.float32)
    ref = PLELayer.from_state_dict(cfg, 1, bf16, storage=PLEStorage("bf16"), dtype=torch.float32)
    assert ours.table.weight.is_pinned() == host
    ids = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    batch = PLEBatch.from_lengths(ids, [200, 100], [0, 2], [False, False])
    state = PLEState.zeros(ref.state_shapes(), 3, torch.float32)
    want = ref.lookup(batch, state)
    got = ours.lookup(PLEBatch.from_lengths(ids.cuda(), [200, 100], [0, 2], [False, False]), PLEState.zeros(ref.state_shapes(), 3, torch.float32, "cuda"))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("scale", [torch.tensor([0.25], dtype=torch.bfloat16), torch.tensor(0.25), torch.tensor([0.25], dtype=torch.float16)],
                         ids=["bf16[1]", "fp32[]", "fp16[1]"])  # fmt: skip
def test_table_scale_any_float_dtype_and_shape(fmt, scale):
    """Upstream copies the one table scale into an fp32 parameter: bf16, fp16, fp32, shape [1] or [] all load
    to the same table."""
    cfg = tiny_text_config(**NVFP4_CFG)
    quantized, bf16 = upstream_layout(ple_state_dict(cfg, 1, False, seed=3), fmt, table_scale=scale)
    ours = PLELayer.from_state_dict(cfg, 1, quantized, storage=PLEStorage(fmt), dtype=torch.float32)
    assert ours.table.tensor_scale.tolist() == [0.25]
    ref = PLELayer.from_state_dict(cfg, 1, bf16, storage=PLEStorage("bf16"), dtype=torch.float32)
    ids = torch.arange(cfg.vocab_size)
    batch = PLEBatch.from_lengths(ids, [cfg.vocab_size], [0], [False])
    state = lambda: PLEState.zeros(ref.state_shapes(), 1, torch.float32)  # noqa: E731
    assert torch.equal(ours.lookup(batch, state()), ref.lookup(batch, state()))


def test_upstream_table_errors_name_the_tensor():
    cfg = tiny_text_config(**NVFP4_CFG)
    quantized, _ = upstream_layout(ple_state_dict(cfg, 1, False, seed=3), "nvfp4")
    prefix = "model.layers.2.ple."
    scale_2 = TABLE_SCALE["nvfp4"]
    missing = {prefix + k: v for k, v in quantized.items() if k != scale_2}
    with pytest.raises(ValueError, match=r"layers\.2\.ple\.ple_embedding\.ngram_embedding\.weight_scale_2 is missing"):
        PLELayer.from_state_dict(cfg, 1, missing, prefix, storage=PLEStorage("nvfp4"))
    for bad, why in ((0.0, "finite and positive"), (-1.0, "finite and positive"), (float("nan"), "finite and positive"),
                     (float("inf"), "finite and positive")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"ngram_embedding\.weight_scale_2: the table scale must be {why}"):
            PLELayer.from_state_dict(cfg, 1, dict(quantized, **{scale_2: torch.tensor([bad])}), storage=PLEStorage("nvfp4"))
    with pytest.raises(ValueError, match=r"weight_scale_2: expected one floating-point scale"):
        PLELayer.from_state_dict(cfg, 1, dict(quantized, **{scale_2: torch.tensor([0.5, 0.5])}), storage=PLEStorage("nvfp4"))
    with pytest.raises(ValueError, match=r"weight_scale_2: expected one floating-point scale"):
        PLELayer.from_state_dict(cfg, 1, dict(quantized, **{scale_2: torch.tensor([1], dtype=torch.int32)}), storage=PLEStorage("nvfp4"))
    with pytest.raises(ValueError, match=r"weight_scale_2: a table-level scale in a table the checkpoint's config declares int8"):
        PLELayer.from_state_dict(cfg, 1, quantized, storage=PLEStorage("int8"))
    with pytest.raises(ValueError, match=r"shard_0\.weight: a torch\.uint8 shard in a table the checkpoint's config declares int8"):
        PLELayer.from_state_dict(cfg, 1, {k: v for k, v in quantized.items() if k != scale_2}, storage=PLEStorage("int8"))
    fp8, _ = upstream_layout(ple_state_dict(cfg, 1, False, seed=3), "fp8")
    with pytest.raises(ValueError, match=r"shard_0\.weight: a torch\.float8_e4m3fn shard in a table the checkpoint's config declares bf16"):
        PLELayer.from_state_dict(cfg, 1, fp8, storage=PLEStorage("bf16"))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_old_per_shard_scales_fail_with_how_to_convert(fmt):
    """Our earlier writer put a copy of the table scale in every shard; such a checkpoint must not load
    (silently or otherwise): the error names the tensor and the command that converts it."""
    cfg = tiny_text_config(**NVFP4_CFG)
    quantized, _ = upstream_layout(ple_state_dict(cfg, 1, False, seed=3), fmt)
    old = {k: v for k, v in quantized.items() if k != TABLE_SCALE[fmt]}
    old[SHARD.format(0) + ("_scale" if fmt == "fp8" else "_scale_2")] = torch.tensor([0.25])
    with pytest.raises(ValueError, match=r"shard_0\.weight_scale(_2)?: a per-shard table scale.*python -m qwen4_exp_hcu\.quantize"):
        PLELayer.from_state_dict(cfg, 1, old, storage=PLEStorage(fmt))
