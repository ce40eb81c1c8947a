"""The PLE table formats: one `TableFormat` record each in `FORMATS`, which every format rule reads (storage
and loading in `ple.table`, which hands the lookup kernel its `kernel_args`, the quantizer, the config
declarations), and the arithmetic of the formats besides INT8 (`ple.int8`), in upstream vLLM's checkpoint layout:

* `fp8`: float8 e4m3 rows (`shard_{j}.weight`) and one scale for the whole table
  (`ngram_embedding.weight_scale`): `w = bf16(e4m3) * bf16(scale)`, multiplied in bf16 as upstream does.
* `nvfp4`: e2m1 values packed two per byte (`shard_{j}.weight` uint8 `[rows, d/2]`, low nibble = even
  column), one e4m3 scale per 16 values (`shard_{j}.weight_scale` `[rows, d/16]`) and one scale for the
  whole table (`ngram_embedding.weight_scale_2`): `w = (e2m1 * block_scale) * weight_scale_2`, in that order.
Every dequantization ends with one fp32 -> bf16 rounding (to nearest even), which the fused kernel
reproduces bit for bit (an e4m3 value times a bf16 scale is exact in fp32). `quantize_nvfp4_rows` writes the
NVFP4 layout (the quantizer's 4-bit output).

Dtypes are named as torch spells them, and torch is imported by the functions that use it: the quantizer's
`--help` reads the registry without loading torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qwen4_exp_hcu.names import TABLE_SCALE_PART

if TYPE_CHECKING:
    import torch

NVFP4_BLOCK = 16
E4M3_MAX, E2M1_MAX = 448.0, 6.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code & 7 (sign in bit 3)
# the same dtypes as safetensors headers name them (the quantizer plans files from headers alone, without torch;
# tests hold them to the safetensors library's own codes)
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32", "int8": "I8", "float8_e4m3fn": "F8_E4M3", "uint8": "U8"}


@dataclass(frozen=True)
class RowScale:
    """The scales read with each row: `shard_{j}.weight_scale`, `[rows, 1]` or one per `block` values."""

    dtype: str
    block: int | None = None  # values per scale; None: one scale for the whole row

    def shape(self, rows: int, dim: int) -> tuple[int, int]:
        return rows, 1 if self.block is None else dim // self.block


@dataclass(frozen=True)
class TableFormat:
    """How one format stores a table. `dequantize(rows, row scales, table scale)` is its arithmetic, as upstream
    dequantizes (the lookup kernel's `kind == kernel` branch reproduces it bit for bit); `quantize(float rows, table scale) -> (rows, row scales)` and
    `quantize_table_scale(largest magnitude)` are what the quantizer writes (None: it does not write this format)."""

    name: str  # as configs, `PLETable.format.name` and the quantizer's --format spell it
    weight: str  # dtype of the stored rows (`shard_{j}.weight`)
    kernel: int  # the row layout `kernels.gather_dequant` reads it as (its `kind`)
    dequantize: Callable
    label: str  # what `PLETable.describe` calls it
    pack: int = 1  # values per stored element
    row_scale: RowScale | None = None
    table_scale: str | None = None  # the one scale of the table: its checkpoint part (`names.TABLE_SCALE_PART`)
    table_scale_dtype: str | None = None  # its precision: what upstream multiplies in, what the quantizer writes
    quantize: Callable | None = None
    quantize_table_scale: Callable | None = None
    upstream_dtype: str | None = None  # the text config's `ple_embedding_dtype` that declares it
    modelopt_algo: str | None = None  # the `quant_algo` of a ModelOpt `quantized_layers` entry that declares it

    @property
    def checkpoint_dtype(self) -> str:
        return SAFETENSORS_DTYPES[self.weight]

    @property
    def kernel_args(self) -> dict:
        """What the lookup kernel (`kernels.gather_dequant`) reads this format by: its row layout and the values per
        block scale."""
        return {"kind": self.kernel, "block": None if self.row_scale is None else self.row_scale.block}

    @property
    def hot_rows(self) -> bool:
        """The hot-row cache serves it: the lookup kernel's cache path reads its rows (whole, one scale at most)."""
        from qwen4_exp_hcu.kernels.gather_dequant import CACHED_KINDS

        return self.kernel in CACHED_KINDS

    def check_width(self, dim: int) -> None:
        """Rows of `dim` values are whole blocks of this format's block scales, else an error naming the head dim."""
        block = self.row_scale.block if self.row_scale else None
        if block and dim % block:
            raise ValueError(f"{self.name.upper()} PLE rows hold blocks of {block} values; the head dim {dim} is not a multiple.")

    def weight_shape(self, rows: int, dim: int) -> tuple[int, int]:
        return rows, dim // self.pack

    def row_bytes(self, dim: int) -> int:
        """Bytes of one stored row with its row scales (the table scale aside)."""
        import torch

        size = dim // self.pack * getattr(torch, self.weight).itemsize
        if self.row_scale is not None:
            size += self.row_scale.shape(1, dim)[1] * getattr(torch, self.row_scale.dtype).itemsize
        return size


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def stored_as(dtype: torch.dtype) -> TableFormat | None:
    """The format whose rows are stored in `dtype` (each format has its own)."""
    return _BY_WEIGHT.get(_name(dtype))


def table_format(weight: torch.Tensor, scale: torch.Tensor | None) -> str:
    """The format a (weight, scale) pair is stored in, from their dtypes. `scale` as the lookup kernel takes it:
    the row scales, else the table scale, else None."""
    fmt = stored_as(weight.dtype)
    scaled = fmt is not None and (fmt.row_scale is not None or fmt.table_scale is not None)
    if fmt is None or (scale is not None) != scaled or (fmt.row_scale and _name(scale.dtype) != fmt.row_scale.dtype):
        raise ValueError(f"PLE table: no row format stores weight {weight.dtype} with scale {getattr(scale, 'dtype', None)}.")
    return fmt.name


def check_hot_rows(name: str, setting: str = "") -> None:
    """A hot-row cache over a table of format `name`: an error (prefixed by `setting`) unless the cache serves it."""
    if not FORMATS[name].hot_rows:
        served = " and ".join(f.name.upper() for f in FORMATS.values() if f.hot_rows)
        raise ValueError(f"{setting}the hot-row cache serves {served} PLE tables, not {name}.")


def dequantize_fp8_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Upstream's arithmetic: both factors in bf16 (e4m3 -> bf16 is exact; the scale is rounded), one rounding."""
    import torch

    return weight.to(torch.bfloat16) * scale.to(torch.bfloat16).reshape(())


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 `[..., d/2]` -> fp32 `[..., d]` e2m1 values (low nibble first)."""
    import torch

    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(_E2M1, device=packed.device)[codes & 7]
    return torch.where(codes >= 8, -values, values)


def dequantize_nvfp4_rows(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    import torch

    values = unpack_e2m1(packed) * block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return (values * global_scale.float().reshape(())).to(torch.bfloat16)


def nvfp4_tensor_scale(amax: float) -> torch.Tensor:
    """fp32 `weight_scale_2` for a table whose largest magnitude is `amax`: the largest block scale fits e4m3."""
    import torch

    return torch.tensor([max(amax, 1e-12) / (E4M3_MAX * E2M1_MAX)], dtype=torch.float32)


def quantize_nvfp4_rows(rows: torch.Tensor, tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] rows -> (packed e2m1 uint8 [n, d/2], e4m3 block scales [n, d/16]): each block scaled so its
    largest magnitude maps to e2m1's 6, every value rounded to the nearest e2m1 code (ties to the lower)."""
    import torch

    blocks = rows.float().unflatten(-1, (-1, NVFP4_BLOCK))
    g = tensor_scale.float().reshape(())
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX / g).clamp(2**-9, E4M3_MAX).to(torch.float8_e4m3fn)
    x = blocks / (block_scale.float() * g)[..., None]
    code = (x.abs()[..., None] - torch.tensor(_E2M1, device=rows.device)).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.flatten(-2).to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), block_scale


def _int8_rows(q: torch.Tensor, scale: torch.Tensor, table_scale=None) -> torch.Tensor:
    from qwen4_exp_hcu.ple.formats.int8 import dequantize_rows

    return dequantize_rows(q, scale)


def _int8_quantize(rows: torch.Tensor, table_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    from qwen4_exp_hcu.ple.formats.int8 import quantize_rows

    return quantize_rows(rows)


FORMATS: dict[str, TableFormat] = {
    f.name: f
    for f in (
        TableFormat("bf16", "bfloat16", kernel=0, dequantize=lambda w, s, t: w, label="bf16"),
        TableFormat(
            "int8", "int8", kernel=1, dequantize=_int8_rows, label="int8+bf16 scale",
            row_scale=RowScale("bfloat16"),  # `ple.int8.SCALE_DTYPE`, compressed-tensors' scale
            quantize=_int8_quantize,
        ),
        TableFormat(
            "fp8", "float8_e4m3fn", kernel=2, dequantize=lambda w, s, t: dequantize_fp8_rows(w, t),
            label="fp8 e4m3+table scale", table_scale=TABLE_SCALE_PART["fp8"], table_scale_dtype="bfloat16",
            upstream_dtype="float8_e4m3fn", modelopt_algo="FP8",
        ),
        TableFormat(
            "nvfp4", "uint8", kernel=3, dequantize=dequantize_nvfp4_rows,
            label="nvfp4 e2m1+e4m3 block scales+table scale", pack=2, row_scale=RowScale("float8_e4m3fn", NVFP4_BLOCK),
            table_scale=TABLE_SCALE_PART["nvfp4"], table_scale_dtype="float32",
            quantize=quantize_nvfp4_rows, quantize_table_scale=nvfp4_tensor_scale, upstream_dtype="nvfp4",
            modelopt_algo="NVFP4",
        ),
    )
}  # fmt: skip
_BY_WEIGHT = {f.weight: f for f in FORMATS.values()}
