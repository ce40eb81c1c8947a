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
