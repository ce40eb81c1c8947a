"""INT8 row format of the PLE tables (compressed-tensors `int-quantized`, one bf16 scale per vocab row).

The numbers are those compressed-tensors' channel strategy produces (`calculate_qparams` + `quantize`):
scale = absmax / 127.5 in the weight's dtype, rounded to bf16, zero scales replaced by bf16 eps;
q = round(clamp(w / scale, -128, 127)). Tests hold this file to that oracle bit for bit.
"""

from collections.abc import Iterable

import torch
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    QuantizationType,
)
from compressed_tensors.utils.match import is_match

__all__ = [
    "PLE_TARGET",
    "SCALE_SUFFIX",
    "quantize_rows",
    "dequantize_rows",
    "validate_scale",
    "validate_int8_weight",
    "ple_int8_scheme",
    "ple_quantization_config",
]

# Matches the runtime table (`...ple_embedding.ngram_embedding`) and its checkpoint shards (`....shard_{j}`).
PLE_TARGET = r"re:.*ple_embedding\.ngram_embedding.*"
SCALE_SUFFIX = "weight_scale"

_Q_MIN, _Q_MAX = -128, 127
_HALF_RANGE = (_Q_MAX - _Q_MIN) / 2  # 127.5, compressed-tensors' symmetric divisor
_SCALE_DTYPE = torch.bfloat16
# Formats whose on-disk layout is exactly `weight` int8 + `weight_scale` (same compressor class).
_ROW_FORMATS = (CompressionFormat.int_quantized.value, CompressionFormat.naive_quantized.value)
_GROUP_NAME = "ple_int8"


def _weight_args() -> QuantizationArgs:
    """The one supported scheme; scale_dtype pins the stored scale to bf16 even for fp32 sources."""
    return QuantizationArgs(
        num_bits=8,
        type=QuantizationType.INT,
        symmetric=True,
        strategy=QuantizationStrategy.CHANNEL,
        scale_dtype=_SCALE_DTYPE,
    )


@torch.no_grad()
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a `[rows, d]` bf16/fp32 table to int8 rows + bf16 `[rows, 1]` scales."""
    if weight.dim() != 2:
        raise ValueError(f"PLE table must be 2-D [rows, dim], got shape {list(weight.shape)}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"PLE table must be bfloat16 or float32, got {weight.dtype}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("PLE table has non-finite values; they have no INT8 representation")
    # Same ops, same dtypes and same order as compressed-tensors, so rounding matches exactly.
    absmax = weight.abs().amax(dim=1, keepdim=True)
    scale = (absmax / _HALF_RANGE).to(_SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.finfo(_SCALE_DTYPE).eps, scale)
    q = torch.round(torch.clamp(weight / scale.to(weight.dtype), _Q_MIN, _Q_MAX)).to(torch.int8)
    return q, scale


@torch.no_grad()
def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`q * scale` in fp32, cast to bf16: the reference the gather/dequant kernels are checked against."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(torch.bfloat16)


def validate_scale(scale: torch.Tensor, rows: int, name: str) -> None:
    """Reject a checkpoint scale that would silently corrupt lookups (0 is legal: all-zero rows)."""
    if scale.dtype != _SCALE_DTYPE:
        raise ValueError(f"{name}: scale dtype must be {_SCALE_DTYPE}, got {scale.dtype}")
    if tuple(scale.shape) != (rows, 1):
        raise ValueError(f"{name}: scale shape must be [{rows}, 1], got {list(scale.shape)}")
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name}: scale has non-finite values")
    if bool((scale < 0).any()):
        raise ValueError(f"{name}: scale has negative values")


def validate_int8_weight(weight: torch.Tensor, rows: int, dim: int, name: str) -> None:
    """Reject a quantized table whose dtype/shape does not match the model config."""
    if weight.dtype != torch.int8:
        raise ValueError(f"{name}: weight dtype must be torch.int8, got {weight.dtype}")
    if tuple(weight.shape) != (rows, dim):
        raise ValueError(f"{name}: weight shape must be [{rows}, {dim}], got {list(weight.shape)}")


def _sample_ple_names() -> list[str]:
    """Typical PLE table/shard module names, for configs whose targets are regexes or class names."""
    names = []
    for prefix in ("model.", "model.language_model."):
        for layer in range(128):
            table = f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding"
            names += [table, f"{table}.shard_0"]
    return names


def _check_scheme(group: str, scheme: QuantizationScheme, global_format: str) -> None:
    """Raise unless a group that covers PLE tables uses exactly the supported INT8 row scheme."""
    where = f"quantization_config group {group!r} (targets PLE tables)"
    for field in ("input_activations", "output_activations"):
        if getattr(scheme, field) is not None:
            raise ValueError(f"{where}: {field} quantization is not supported for PLE tables")
    fmt = scheme.format or global_format
    if fmt not in _ROW_FORMATS:
        raise ValueError(f"{where}: format {fmt!r} is not supported, expected one of {list(_ROW_FORMATS)}")
    weights = scheme.weights
    if weights is None:
        raise ValueError(f"{where}: has no weights scheme")
    expected = _weight_args()
    for field in ("num_bits", "type", "symmetric", "strategy", "dynamic", "actorder"):
        got, want = getattr(weights, field), getattr(expected, field)
        if got != want:
            raise ValueError(f"{where}: weights.{field}={got!r} is not supported, expected {want!r}")
    if weights.scale_dtype not in (None, _SCALE_DTYPE):
        raise ValueError(f"{where}: weights.scale_dtype={weights.scale_dtype} is not supported, expected bfloat16")


def ple_int8_scheme(quantization_config: dict | None, module_names: Iterable[str] | None = None) -> bool:
    """Whether the checkpoint stores its PLE tables in the INT8 row format.

    `module_names` are the model's PLE table (or shard) module names; when given, the tables must be
    quantized all or none. Without them a sample of usual names plus any PLE names spelled out in the
    config is matched, which covers regex, class-name and explicit-name targets.
    Raises ValueError for a config group that covers PLE tables with any other scheme.
    """
    if not quantization_config or quantization_config.get("quant_method") != "compressed-tensors":
        return False  # other methods have no notion of this row format
    try:
        config = QuantizationConfig.model_validate(quantization_config)
    except ValueError as e:
        raise ValueError(f"quantization_config is not a valid compressed-tensors config: {e}") from e

    explicit = module_names is not None
    if explicit:
        names = list(module_names)
    else:
        literal = [t for s in config.config_groups.values() for t in s.targets] + list(config.ignore or [])
        names = _sample_ple_names() + [t for t in literal if not t.startswith("re:") and "ngram_embedding" in t]
    table = torch.nn.Embedding(1, 1, device="meta")  # PLE tables are embeddings, for class-name targets
    ignore = config.ignore or []

    covered = set()
    for group, scheme in config.config_groups.items():
        hits = {n for n in names if is_match(n, table, scheme.targets, ignore)}
        if hits:
            _check_scheme(group, scheme, config.format)
            covered |= hits
    if explicit and covered and len(covered) != len(set(names)):
        missing = sorted(set(names) - covered)
        raise ValueError(
            f"quantization_config quantizes only some PLE tables; not covered: {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}"
        )
    return bool(covered)


def ple_quantization_config() -> dict:
    """The `quantization_config` the quantizer writes: one int-quantized group, PLE tables only."""
    scheme = QuantizationScheme(
        targets=[PLE_TARGET],
        weights=_weight_args(),
        format=CompressionFormat.int_quantized,
    )
    config = QuantizationConfig(
        config_groups={_GROUP_NAME: scheme},
        format=CompressionFormat.int_quantized.value,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=[],
    )
    return config.model_dump(mode="json")
