"""Which compressed-tensors configs store the PLE tables in our INT8 row format (`int8`), parsed with
compressed-tensors' own classes, and the config the quantizer writes."""

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

from qwen4_exp_hcu.names import TABLE, TABLE_TARGET, TEXT_PREFIXES
from qwen4_exp_hcu.ple.formats.int8 import SCALE_DTYPE

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
        scale_dtype=SCALE_DTYPE,
    )


def _sample_ple_names() -> list[str]:
    """Typical PLE table/shard module names, for configs whose targets are regexes or class names."""
    names = []
    for prefix in TEXT_PREFIXES:
        for layer in range(128):
            table = f"{prefix}layers.{layer}.ple.{TABLE}"
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
    if weights.scale_dtype not in (None, SCALE_DTYPE):
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
        targets=[TABLE_TARGET],
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


# Where a checkpoint whose main model uses another method (`quant_method: fp8`, ...) declares our INT8 PLE
# tables: a compressed-tensors config of its own under this key of its `quantization_config`.
PLE_KEY = "ple_tables"


def ple_group_names(quantization_config: dict) -> list[str]:
    """Config groups that target PLE tables only (every target names the n-gram embedding)."""
    groups = quantization_config.get("config_groups") or {}
    return [name for name, g in groups.items() if g.get("targets") and all("ngram_embedding" in t for t in g["targets"])]


def ple_tables_config(quantization_config: dict | None) -> dict | None:
    """The compressed-tensors config that declares the PLE tables: the checkpoint's own, or its
    `ple_tables` entry beside another method."""
    if not quantization_config:
        return None
    if quantization_config.get("quant_method") == "compressed-tensors":
        return quantization_config
    return quantization_config.get(PLE_KEY)


def declares_int8_tables(quantization_config: dict | None) -> bool:
    """Whether a checkpoint's `quantization_config` declares PLE tables in our INT8 row format, in a
    group of their own. Raises for a declaration with another scheme."""
    tables = ple_tables_config(quantization_config)
    return tables is not None and bool(ple_group_names(tables)) and ple_int8_scheme(tables)


def main_model_config(quantization_config: dict) -> dict:
    """A compressed-tensors config as the main model reads it: without the PLE group (a copy)."""
    ple = set(ple_group_names(quantization_config))
    groups = {k: v for k, v in (quantization_config.get("config_groups") or {}).items() if k not in ple}
    return {**quantization_config, "config_groups": groups}


def merge_ple_group(quantization_config: dict | None) -> dict:
    """`quantization_config` plus the declaration of our INT8 PLE tables (the quantizer's output): a group
    of a compressed-tensors config, the `ple_tables` entry beside any other method; the rest as it is."""
    ple = ple_quantization_config()
    if not quantization_config:
        return ple
    if declares_int8_tables(quantization_config) or ple_int8_scheme(quantization_config):
        raise ValueError("the checkpoint's quantization_config already quantizes the PLE tables.")
    if quantization_config.get("quant_method") != "compressed-tensors":
        return {**quantization_config, PLE_KEY: ple}
    groups = dict(quantization_config.get("config_groups") or {})
    if _GROUP_NAME in groups:
        raise ValueError(f"the checkpoint's quantization_config already has a group named {_GROUP_NAME!r}.")
    groups[_GROUP_NAME] = ple["config_groups"][_GROUP_NAME]
    return {**quantization_config, "config_groups": groups}
