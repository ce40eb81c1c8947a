"""How a checkpoint declares the format of its PLE tables, in each of the ways the releases and our quantizer
do it, read from its config alone (before any tensor is opened):

* our INT8 rows: a compressed-tensors group of their own (`ple.int8_scheme`);
* upstream's `ple_embedding_dtype` in the text config: `float8_e4m3fn` -> `fp8`, `nvfp4` -> `nvfp4`;
* Qwen's FP8 release: `quant_method: fp8`, whose `modules_to_convert` names the table (upstream's rule:
  an FP8 checkpoint's table is FP8 unless `modules_to_not_convert` lists it);
* NVIDIA's ModelOpt `MIXED_PRECISION` release: `quantized_layers[<table module>].quant_algo == "FP8"`.

Two declarations that disagree are an error naming both, never a guess.
"""

from __future__ import annotations

import copy

from qwen4_exp_hcu.names import TABLE, ple_layers
from qwen4_exp_hcu.ple.formats.rows import FORMATS
from qwen4_exp_hcu.ple.formats.int8_scheme import ple_int8_scheme, ple_tables_config

# how upstream's `ple_embedding_dtype` and ModelOpt's `quant_algo` name our formats
UPSTREAM_DTYPES = {f.upstream_dtype: name for name, f in FORMATS.items() if f.upstream_dtype}
_MODELOPT_ALGOS = {f.modelopt_algo: name for name, f in FORMATS.items() if f.modelopt_algo}


def _runtime(name: str) -> str:
    """A module name as the text model spells it (multimodal checkpoints nest it in `model.language_model.`)."""
    return name.replace("model.language_model.", "model.", 1)


def _names(table: str, modules) -> list[str]:
    """Entries of a module list that name `table` (a part of its path)."""
    return [m for m in modules or [] if m and _runtime(m) in _runtime(table)]


def _fp8_method(qconfig: dict, table: str) -> str | None:
    """Upstream's rule for `quant_method: fp8`: the table is FP8 unless listed as not converted."""
    skipped = _names(table, qconfig.get("modules_to_not_convert"))
    convert = qconfig.get("modules_to_convert")
    named = bool(_names(table, convert))
    if skipped and named:
        raise ValueError(f"quantization_config: {table} is both in modules_to_convert and modules_to_not_convert ({skipped[0]!r}).")
    if convert is not None and not named and not skipped:
        raise ValueError(
            f"quantization_config (quant_method fp8): modules_to_convert {convert} does not name the PLE table {table}; "
            "list it there (as Qwen's FP8 release does), or in modules_to_not_convert for a BF16 table."
        )
    return None if skipped else "fp8"


def _modelopt_method(qconfig: dict, table: str) -> str | None:
    """ModelOpt MIXED_PRECISION: the algorithm of the layer entry that is this table."""
    layers = qconfig.get("quantized_layers") or {}
    algo = next((v.get("quant_algo") for k, v in layers.items() if _runtime(k) == _runtime(table)), None)
    if algo is None:
        return None
    if algo not in _MODELOPT_ALGOS:
        raise ValueError(f"quantization_config.quantized_layers[{table!r}]: quant_algo {algo!r} is not a PLE table format ({sorted(_MODELOPT_ALGOS)}).")
    return _MODELOPT_ALGOS[algo]


def declared_table_format(text_config, quantization_config: dict | None, tables: list[str]) -> str:
    """`bf16`, `int8`, `fp8` or `nvfp4` for the PLE tables named `tables` (`model.layers.{i}.ple.<TABLE>`),
    every table the same. `quantization_config` is the checkpoint's (top-level) dict, or None."""
    found: dict[str, str] = {}  # declaration -> format
    dtype = getattr(text_config, "ple_embedding_dtype", None)
    if dtype is not None:
        if dtype not in UPSTREAM_DTYPES:
            raise ValueError(f"ple_embedding_dtype={dtype!r} is not supported; expected one of {sorted(UPSTREAM_DTYPES)}.")
        found[f"ple_embedding_dtype={dtype!r}"] = UPSTREAM_DTYPES[dtype]
    if ple_int8_scheme(ple_tables_config(quantization_config), tables):
        found["a compressed-tensors INT8 PLE group"] = "int8"
    method = (quantization_config or {}).get("quant_method")
    if tables and method in ("fp8", "modelopt"):
        reader = _fp8_method if method == "fp8" else _modelopt_method
        formats = {reader(quantization_config, t) for t in tables}
        if len(formats) > 1:
            raise ValueError(f"quantization_config ({method}) gives the PLE tables different formats: {sorted(map(str, formats))}.")
        if (fmt := formats.pop()) is not None:
            found[f"quantization_config (quant_method {method})"] = fmt
    if len(set(found.values())) > 1:
        raise ValueError(f"the checkpoint declares its PLE tables twice, differently: {found}.")
    return next(iter(found.values()), "bf16")


def table_names(text_config) -> list[str]:
    """Runtime names of the model's PLE tables, as quantization configs target them."""
    return [f"{index.prefix}{TABLE}" for index in ple_layers(text_config)]


def without_fp8_declarations(quantization_config: dict | None, tables: list[str]) -> dict | None:
    """A copy of `quantization_config` in which the main method no longer declares `tables` FP8 (what the
    quantizer writes before it declares the format it wrote): `fp8` lists them as not converted, ModelOpt
    drops their `quantized_layers` entries."""
    q = copy.deepcopy(quantization_config)
    method = (q or {}).get("quant_method")
    if method == "fp8":
        if q.get("modules_to_convert") is not None:
            q["modules_to_convert"] = [m for m in q["modules_to_convert"] if not any(_names(t, [m]) for t in tables)]
        skipped = q.get("modules_to_not_convert") or []
        q["modules_to_not_convert"] = [*skipped, *(t for t in tables if not _names(t, skipped))]
    elif method == "modelopt" and q.get("quantized_layers"):
        names = {_runtime(t) for t in tables}
        q["quantized_layers"] = {k: v for k, v in q["quantized_layers"].items() if _runtime(k) not in names}
    return q
