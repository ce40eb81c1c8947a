"""FP8 and NVFP4 PLE table numerics against oracles that share no code with ours.

* NVFP4: e2m1 codes are decoded by compressed-tensors' own helpers (`unpack_fp4_from_uint8`,
  `pack_fp4_to_uint8`); the block and table scales are applied as the format defines it,
  `(e2m1 * block_scale) * weight_scale_2` in fp32, then one rounding to bf16.
* FP8: the oracle is upstream vLLM's own `Qwen4ExpPLEFp8EmbeddingMethod.dequantize` (bf16 multiply of the
  e4m3 rows by the bf16-rounded table scale), run on every finite e4m3 byte.

Each format is checked through our torch reference and through the fused Triton kernel, which the Triton
interpreter runs on the CPU (`table.lookup` takes the torch path for CPU ids; `helpers.oracles.triton_lookups`
reroutes that one call to the kernel with the very arguments `lookup` chose). Comparisons are bit-exact
(integer views, so the sign of zero counts), and each test shows its check would catch a plausible mistake.
"""

from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

from helpers.configs import tiny_text_config
from helpers.layers import ple_state_dict
from helpers.oracles import bits, finite_e4m3, lookups
from qwen4_exp_hcu.ple.formats.rows import dequantize_fp8_rows, unpack_e2m1
from qwen4_exp_hcu.ple.hashing import NgramHashSpec
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

TABLE = "ple_embedding.ngram_embedding"
# a bf16 scale as the official FP8 release stores it, and an fp32 one that bf16 cannot hold
SCALES = {
    "bf16": torch.tensor([0.0123], dtype=torch.bfloat16),
    "fp32_not_bf16": torch.tensor([0.0123456789], dtype=torch.float32),
}


def lookup(table: PLETable, ids: torch.Tensor, path: str) -> torch.Tensor:
    with lookups(path):
        return table.lookup(ids)


# ---- NVFP4 -----------------------------------------------------------------------------------------------
ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None]  # [1, 256]: both nibbles, every code


def ct_decode(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' e2m1 decode, fp32 [rows, 2 * bytes]."""
    return unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)


def test_e2m1_decode_of_every_byte_equals_compressed_tensors():
    want = ct_decode(ALL_BYTES)
    assert torch.equal(bits(unpack_e2m1(ALL_BYTES)), bits(want))
    assert int(want.signbit().sum()) == 256 and int((want < 0).sum()) == 224  # codes 8..15 per nibble; 8 is -0.0
    # sensitivity: reading the high nibble first breaks every byte whose two nibbles differ
    swapped = (ALL_BYTES << 4) | (ALL_BYTES >> 4)
    wrong = (bits(unpack_e2m1(swapped)) != bits(want)).view(256, 2).any(-1)
    assert int(wrong.sum()) == 256 - 16


def test_e2m1_values_packed_by_compressed_tensors_decode_back():
    """Packing direction: compressed-tensors writes the even column to the low nibble, as we read it."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    g = torch.Generator().manual_seed(0)
    x = grid[torch.randint(0, 8, (5, 64), generator=g)] * torch.where(torch.rand(5, 64, generator=g) < 0.5, -1.0, 1.0)
    packed = pack_fp4_to_uint8(x)
    assert torch.equal(bits(unpack_e2m1(packed)), bits(x))


def nvfp4_reference(packed, block_scale, scale_2) -> torch.Tensor:
    """(e2m1 * block_scale) * weight_scale_2 in fp32, then bf16; e2m1 from compressed-tensors."""
    values = ct_decode(packed) * block_scale.float().repeat_interleave(16, dim=-1)
    return (values * scale_2.float().reshape(())).to(torch.bfloat16)


def nvfp4_table(rows=48, dim=32, seed=0):
    """Packed rows cycling through all 256 bytes, every positive finite e4m3 block scale, a non-bf16 scale_2."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.arange(rows * dim // 2, dtype=torch.int32)[torch.randperm(rows * dim // 2, generator=g)] % 256
    packed = packed.to(torch.uint8).view(rows, dim // 2)
    return packed, finite_e4m3((rows, dim // 16), seed, positive=True), torch.tensor([0.0123456789])


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_nvfp4_table_lookup_equals_compressed_tensors_decode(path):
    packed, block, scale_2 = nvfp4_table()
    rows, dim = packed.shape[0], packed.shape[1] * 2
    table = PLETable(rows, dim, PLEStorage("nvfp4"))  # storage filled directly: the numerics, not the loader
    table.weight.copy_(packed)
    table.scale.copy_(block)
    table.tensor_scale.copy_(scale_2)
    ids = torch.cat([torch.arange(rows), torch.randint(0, rows, (40,), generator=torch.Generator().manual_seed(1))])
    ids = ids.view(-1, 4)  # [T, H]
    want = nvfp4_reference(packed, block, scale_2)[ids].flatten(1)
    got = lookup(table, ids, path)
    assert torch.equal(bits(got), bits(want))
    # sensitivity: FP8-style bf16 arithmetic (bf16 block-scaled value times the bf16-rounded scale_2)
    block_scaled = (ct_decode(packed) * block.float().repeat_interleave(16, -1)).to(torch.bfloat16)
    wrong = (block_scaled * scale_2.to(torch.bfloat16))[ids].flatten(1)
    assert (bits(wrong) != bits(want)).float().mean() > 0.05


@pytest.mark.parametrize(
    "scale_2", [torch.tensor(0.25, dtype=torch.bfloat16), torch.tensor([0.0123456789])], ids=["bf16[]", "fp32[1]"]
)
def test_nvfp4_layer_with_table_level_scale_2_equals_compressed_tensors_decode(scale_2):
    """The checkpoint contract: `shard_{j}.weight` uint8 + `shard_{j}.weight_scale` e4m3 per shard, ONE
    `ngram_embedding.weight_scale_2` (any float dtype, [] or [1]). The last shard is shorter."""
    cfg = tiny_text_config(ple_embed_dim=64, split_ngram_parts=5)  # 4 heads of 16: one NVFP4 block each
    spec = NgramHashSpec.from_config(cfg, 1)
    packed, block, _ = nvfp4_table(spec.rows, spec.head_dim, seed=2)
    n = -(-spec.rows // cfg.split_ngram_parts)
    assert spec.rows % cfg.split_ngram_parts and spec.rows - 4 * n < n
    sd = {k: v for k, v in ple_state_dict(cfg, 1, False, seed=0).items() if TABLE not in k}
    for j in range(cfg.split_ngram_parts):
        rows = slice(j * n, (j + 1) * n)
        sd[f"{TABLE}.shard_{j}.weight"], sd[f"{TABLE}.shard_{j}.weight_scale"] = packed[rows], block[rows]
    sd[f"{TABLE}.weight_scale_2"] = scale_2
    layer = PLELayer.from_state_dict(cfg, 1, sd, storage=PLEStorage("nvfp4"))
    ids = torch.randint(0, spec.rows, (50, spec.num_heads), generator=torch.Generator().manual_seed(3))
    want = nvfp4_reference(packed, block, scale_2)[ids].flatten(1)
    assert torch.equal(bits(layer.table.lookup(ids)), bits(want))


# ---- FP8 -------------------------------------------------------------------------------------------------
def upstream_fp8(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Upstream's dequantize of looked-up e4m3 rows. It reads `layer.weight_scale`, which upstream keeps as
    an fp32 [1] parameter holding the checkpoint's value (copied from whatever float dtype it had)."""
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEFp8EmbeddingMethod

    layer = SimpleNamespace(weight_scale=scale.float().reshape(1))
    return Qwen4ExpPLEFp8EmbeddingMethod().dequantize(layer, rows, torch.bfloat16)


def old_fp8(rows, scale):
    """The arithmetic our library used before: fp32 multiply, one rounding."""
    return (rows.float() * scale.float().reshape(())).to(torch.bfloat16)


@pytest.mark.vllm_qwen4_exp
@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
def test_fp8_rows_equal_upstream_dequantize(scale):
    w = finite_e4m3((254, 64), seed=0)  # every finite e4m3 value 64 times
    want = upstream_fp8(w, scale)
    assert want.dtype == torch.bfloat16
    assert torch.equal(bits(dequantize_fp8_rows(w, scale)), bits(want))
    # sensitivity: truncating instead of rounding to nearest even differs on a large share of values
    truncated = (bits(w.float() * scale.to(torch.bfloat16).float()) >> 16).to(torch.int16)
    assert (truncated != bits(want)).float().mean() > 0.2
    mismatch = (bits(old_fp8(w, scale)) != bits(want)).float().mean()
    if scale.dtype == torch.bfloat16:  # a bf16 scale: fp32 and bf16 multiplies agree (e4m3 * bf16 is exact in fp32)
        assert mismatch == 0
    else:  # a scale bf16 cannot hold: the old fp32 multiply disagrees with upstream on a measurable fraction
        assert scale.to(torch.bfloat16).float() != scale
        assert mismatch > 0.05, mismatch


def fp8_layer(scale: torch.Tensor, seed=0):
    """A PLE layer loaded from the FP8 checkpoint contract (e4m3 shards, last one shorter, ONE table-level
    `ngram_embedding.weight_scale`), and its full e4m3 table."""
    cfg = tiny_text_config(split_ngram_parts=5)
    spec = NgramHashSpec.from_config(cfg, 1)
    table = finite_e4m3((spec.rows, spec.head_dim), seed)
    n = -(-spec.rows // cfg.split_ngram_parts)
    assert spec.rows % cfg.split_ngram_parts
    sd = {k: v for k, v in ple_state_dict(cfg, 1, False, seed=seed).items() if TABLE not in k}
    sd.update({f"{TABLE}.shard_{j}.weight": table[j * n : (j + 1) * n] for j in range(cfg.split_ngram_parts)})
    sd[f"{TABLE}.weight_scale"] = scale
    return PLELayer.from_state_dict(cfg, 1, sd, storage=PLEStorage("fp8")), table, spec


@pytest.mark.vllm_qwen4_exp
@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
def test_fp8_table_lookup_equals_upstream_dequantize(scale, path):
    """Needs the loader change: one table-level `weight_scale` (bf16 in the release), bf16 arithmetic."""
    layer, table, spec = fp8_layer(scale)
    g = torch.Generator().manual_seed(4)
    ids = torch.cat([torch.arange(spec.rows), torch.randint(0, spec.rows, (spec.num_heads * 30,), generator=g)])
    ids = ids[: ids.numel() // spec.num_heads * spec.num_heads].view(-1, spec.num_heads)  # every row, some twice
    want = upstream_fp8(table[ids], scale).flatten(1)
    got = lookup(layer.table, ids, path)
    assert torch.equal(bits(got), bits(want))
    if scale.dtype != torch.bfloat16:  # sensitivity: the old fp32 product is not what we serve
        assert not torch.equal(bits(got), bits(old_fp8(table[ids], scale).flatten(1)))
