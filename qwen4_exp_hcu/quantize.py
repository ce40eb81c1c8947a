"""Quantize the PLE tables of a Qwen4Exp checkpoint (BF16, F32, F16, or upstream's FP8 / NVFP4 layouts, e.g. the
FP8 release's) to INT8 rows, or to upstream's NVFP4 layout (4 bits + block scales: 72 B per row of 128 values
against INT8's 130).

    python -m qwen4_exp_hcu.quantize SRC DST [--format int8|nvfp4]

INT8: every `...ple_embedding.ngram_embedding.shard_{j}.weight` becomes int8 `weight` + bf16 `weight_scale`
in the same file; config.json gains a compressed-tensors PLE group, merged into the main model's
compressed-tensors `quantization_config` when it has one (kept as it is otherwise). NVFP4: every shard
becomes packed e2m1 `weight` + e4m3 `weight_scale`, and each table gets ONE fp32
`...ngram_embedding.weight_scale_2` (from a first pass over its shards), declared by the text config's
`ple_embedding_dtype: "nvfp4"` as upstream does. A main method's FP8 declaration of the tables (`fp8`'s
`modules_to_convert`, ModelOpt's `quantized_layers`) is removed. Every other tensor is copied byte for byte.
Tensors are streamed one at a time (the PLE tables alone are ~90 GiB in BF16), and the output is built in a
temporary folder beside DST and renamed into place only when complete. Everything that can be checked without the
tensors' data (config, tokenizer, every file's header, table dtypes and scales) is checked before that folder is
made; a bad input is a one-line error naming its file, tensor or setting. This module plans what becomes of each
tensor; `checkpoint_folder` reads and writes the folder's files. torch, transformers and safetensors are imported
by the functions that use them, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qwen4_exp_hcu.checkpoint_folder import (
    CONFIG, INDEX, MODELOPT_CONFIG, TOKENIZER_FILES, check_config, copy_other_files, has_tokenizer, open_all, read_json,
    weight_files, write_safetensors,
)  # fmt: skip
from qwen4_exp_hcu.names import SCALE_SUFFIX, TABLE_SCALE_PART, TABLE_TARGET
from qwen4_exp_hcu.ple.formats.rows import FORMATS, SAFETENSORS_DTYPES, stored_as

if TYPE_CHECKING:
    import torch

    from qwen4_exp_hcu.ple.formats.rows import TableFormat

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
# upstream's layouts, read and converted: the formats with one scale per table, by their rows' dtype (FP8, NVFP4)
_UPSTREAM = {f.checkpoint_dtype: f for f in FORMATS.values() if f.table_scale}
# float rows (F16 is widened to F32, exactly) and upstream's layouts
_SOURCE_TABLE_DTYPES = ("BF16", "F32", "F16", *_UPSTREAM)
TARGETS = tuple(name for name, f in FORMATS.items() if f.quantize)  # what `--format` writes


def is_ple_table(tensor_name: str) -> bool:
    """True for a PLE table shard's weight, judged by the same target the written config declares."""
    from compressed_tensors.utils.match import match_name

    module, _, param = tensor_name.rpartition(".")
    return param == "weight" and ".shard_" in module and match_name(module, TABLE_TARGET)


def _scale_name(weight_name: str) -> str:
    return f"{weight_name.removesuffix('weight')}{SCALE_SUFFIX}"


def _table_of(shard_name: str) -> str:
    """`...ngram_embedding.shard_{j}.weight` -> `...ngram_embedding`: the table a shard belongs to."""
    return shard_name.rsplit(".shard_", 1)[0]


def _nbytes(name: str, dtype: str, shape: list[int]) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{name}: safetensors dtype {dtype} is not supported by the quantizer")
    return _DTYPE_BYTES[dtype] * math.prod(shape)


class _Entry:
    """One output tensor: header facts known up front, bytes produced only when written. `copied`: the
    source tensor as it is (everything but the PLE tables and their scales)."""

    def __init__(self, name: str, dtype: str, shape: list[int], produce: Callable[[], torch.Tensor], copied=False):
        self.name, self.dtype, self.shape, self.produce, self.copied = name, dtype, shape, produce, copied
        self.nbytes = _nbytes(name, dtype, shape)


def _is_table_shard(e: _Entry) -> bool:
    """A table shard's weight in `target`'s format (what the progress bar counts)."""
    return not e.copied and is_ple_table(e.name)


def _source_rows(f, name: str, source_scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """A PLE table shard as float rows: BF16/F32 as stored, F16 widened to F32 (exact); upstream's FP8 (e4m3 +
    the table's `weight_scale`) and NVFP4 (packed e2m1 + e4m3 block `weight_scale` + the table's
    `weight_scale_2`) dequantized to BF16."""
    import torch

    weight = f.get_tensor(name)
    source = stored_as(weight.dtype)
    if source is not None and source.table_scale:  # upstream's layouts
        row_scale = f.get_tensor(_scale_name(name)) if source.row_scale else None
        return source.dequantize(weight, row_scale, source_scales[_table_of(name)])
    return weight.float() if weight.dtype == torch.float16 else weight


def _has_row_scales(dtype: str) -> bool:
    """Whether a source shard of this dtype comes with per-shard scales (`shard_{j}.weight_scale`: NVFP4's)."""
    return dtype in _UPSTREAM and _UPSTREAM[dtype].row_scale is not None


def _check_table_shard(name: str, dtype: str, shape: list[int]) -> None:
    if dtype == FORMATS["int8"].checkpoint_dtype:
        raise ValueError(f"{name}: PLE table already quantized (INT8 rows); quantize from the BF16 checkpoint")
    if dtype not in _SOURCE_TABLE_DTYPES:
        raise ValueError(f"{name}: PLE table dtype {dtype} is not a source the quantizer reads {_SOURCE_TABLE_DTYPES}")
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a 2-D PLE table shard [rows, values], got shape {shape}")


def _plan_file(
    f, target: TableFormat, source_scales: dict[str, torch.Tensor], tensor_scales: dict[str, torch.Tensor] | None,
    written: set[str],
) -> list[_Entry]:  # fmt: skip
    """Output tensors of one safetensors file; a PLE table shard expands to `target`'s weight + row scales (INT8:
    a bf16 scale per row; NVFP4: packed e2m1 + e4m3 block scales, and, from `tensor_scales` {table: fp32 scale},
    the table's one scale in the file of its first shard; `written` tracks those), and the scales of an
    FP8/NVFP4 source table are dropped."""
    entries, keys = [], set(f.keys())
    dropped = {_scale_name(n) for n in keys if is_ple_table(n) and _has_row_scales(f.get_slice(n).get_dtype())}
    dropped |= {f"{t}.{fmt.table_scale}" for t in source_scales for fmt in _UPSTREAM.values()}
    for name in f.keys():
        sl = f.get_slice(name)
        dtype, shape = sl.get_dtype(), list(sl.get_shape())
        if name in dropped:
            continue
        if not is_ple_table(name):
            entries.append(_Entry(name, dtype, shape, lambda name=name: f.get_tensor(name), copied=True))
            continue
        _check_table_shard(name, dtype, shape)
        source = _UPSTREAM.get(dtype)
        if _has_row_scales(dtype) and _scale_name(name) not in keys:
            raise ValueError(f"{_scale_name(name)}: missing beside its {source.name.upper()} PLE table shard (expected in the same file)")
        width = shape[1] * (source.pack if source else 1)
        block = target.row_scale.block
        if block and width % block:
            raise ValueError(f"{name}: {target.name.upper()} rows hold blocks of {block} values; the row width {width} is not a multiple")
        table = _table_of(name)
        table_scale = None if tensor_scales is None else tensor_scales[table]
        stash: dict[str, torch.Tensor] = {}  # the scale waits here for the entry written right after its weight

        def weight(name=name, stash=stash, table_scale=table_scale):
            try:
                q, stash["scale"] = target.quantize(_source_rows(f, name, source_scales), table_scale)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            return q

        entries.append(_Entry(name, target.checkpoint_dtype, list(target.weight_shape(shape[0], width)), weight))
        scale_dtype, scale_shape = SAFETENSORS_DTYPES[target.row_scale.dtype], list(target.row_scale.shape(shape[0], width))
        entries.append(_Entry(_scale_name(name), scale_dtype, scale_shape, lambda stash=stash: stash.pop("scale")))
        if table_scale is not None and table not in written:
            written.add(table)
            scale_dtype = SAFETENSORS_DTYPES[target.table_scale_dtype]
            entries.append(_Entry(f"{table}.{target.table_scale}", scale_dtype, [1], lambda table_scale=table_scale: table_scale))
    return entries


def _load_config(src: Path, fmt: str, tables: list[str]) -> dict:
    """SRC's config declaring the tables in `fmt`: a format upstream names (NVFP4) as the text config's
    `ple_embedding_dtype`, upstream's marker; INT8 as our PLE group merged into its quantization config (kept as
    it is otherwise). Earlier FP8 declarations of the tables are removed first."""
    from qwen4_exp_hcu.ple.formats.declaration import without_fp8_declarations
    from qwen4_exp_hcu.ple.formats.int8_scheme import merge_ple_group

    config = read_json(src / CONFIG)
    text = config.get("text_config") or config  # multimodal checkpoints nest the text model's config
    if "compression_config" in config or "quantization_config" in (config.get("text_config") or {}):
        raise ValueError(f"{src / CONFIG}: put the main model's quantization config at the top level as quantization_config")
    text.pop("ple_embedding_dtype", None)  # upstream's FP8/NVFP4 table marker, replaced below
    if config.get("quantization_config"):
        config["quantization_config"] = without_fp8_declarations(config["quantization_config"], tables)
    if FORMATS[fmt].upstream_dtype:
        text["ple_embedding_dtype"] = FORMATS[fmt].upstream_dtype
        return config
    main = config.get("quantization_config")
    if main is None and (src / MODELOPT_CONFIG).is_file():  # ModelOpt <= 0.29 keeps it beside config.json
        main = read_json(src / MODELOPT_CONFIG)  # as vLLM reads it when config.json has none
    try:
        config["quantization_config"] = merge_ple_group(main)
    except ValueError as e:
        raise ValueError(f"{src / CONFIG}: {e}") from None
    return config


def _table_scales(handles, source_scales, target: TableFormat) -> dict[str, torch.Tensor]:
    """`target`'s one scale per table (NVFP4: fp32), from its largest magnitude over all its shards (a first pass)."""
    amax: dict[str, float] = {}
    for f in handles:
        for name in filter(is_ple_table, f.keys()):
            peak = _source_rows(f, name, source_scales).float().abs().max().item()
            amax[_table_of(name)] = max(amax.get(_table_of(name), 0.0), peak)
    return {table: target.quantize_table_scale(peak) for table, peak in amax.items()}


_OLD_LAYOUT = "an earlier qwen4_exp_hcu layout (a table scale per shard); quantize from the BF16 checkpoint instead"


def _source_table_scales(handles, dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """The one scale of each upstream FP8 / NVFP4 source table ({table: scale}), wherever its file; a missing
    one, or the old per-shard copies, is an error naming the tensor."""
    where = {k: h for h in handles for k in h.keys()}
    scales = {}
    for name in filter(is_ple_table, dtypes):
        dtype, table = dtypes[name], _table_of(name)
        own = {SCALE_SUFFIX} if _has_row_scales(dtype) else set()  # NVFP4's block scales are no copy
        shard = name.removesuffix("weight")
        copies = [shard + part for part in TABLE_SCALE_PART.values() if part not in own and shard + part in dtypes]
        if copies:
            raise ValueError(f"{copies[0]}: {_OLD_LAYOUT}")
        if dtype in _UPSTREAM and table not in scales:
            scale_name = f"{table}.{_UPSTREAM[dtype].table_scale}"
            if scale_name not in where:
                raise ValueError(f"{scale_name}: missing, the one scale of the {dtype} PLE table {table}")
            scales[table] = where[scale_name].get_tensor(scale_name)
    return scales


def _plan(src: Path, handles, target: TableFormat) -> list[list[_Entry]]:
    """The output tensors of every file of SRC, in order; every check that needs no table data is made here."""
    dtypes = {k: h.get_slice(k).get_dtype() for h in handles for k in h.keys()}
    scales = [n for n in dtypes if n.endswith(f".{SCALE_SUFFIX}") and is_ple_table(n.removesuffix("_scale"))]
    stray = [n for n in scales if dtypes.get(n.removesuffix("_scale")) not in _UPSTREAM]
    if stray:  # only upstream's NVFP4 tables come with per-shard scales to convert
        raise ValueError(f"{stray[0]}: SRC already holds quantized PLE tables")
    if not any(map(is_ple_table, dtypes)):
        raise ValueError(f"no PLE tables (...ple_embedding.ngram_embedding.shard_j.weight) in {src}")
    source_scales = _source_table_scales(handles, dtypes)
    tensor_scales = _table_scales(handles, source_scales, target) if target.table_scale else None
    written: set[str] = set()
    return [_plan_file(f, target, source_scales, tensor_scales, written) for f in handles]


@dataclass(frozen=True)
class Summary:
    """What a conversion did to the PLE tables (shards and their scales; every other tensor is copied)."""

    tables: int
    rows: int
    bytes_before: int
    bytes_after: int
    seconds: float

    def __str__(self) -> str:
        return (f"PLE tables {self.tables}, rows {self.rows:,}, bytes {self.bytes_before:,} -> {self.bytes_after:,}, "
                f"{self.seconds:.1f} s")  # fmt: skip


def _write(src: Path, out: Path, files: list[str], handles, plans: list[list[_Entry]], config: dict, index) -> None:
    """DST's content into `out`: the planned safetensors files, config.json, the index, the side files."""
    from tqdm import tqdm

    shards = sum(map(_is_table_shard, (e for plan in plans for e in plan)))
    with tqdm(total=shards, desc="Quantizing PLE shards", unit="shard") as progress:

        def written(e: _Entry) -> None:
            if _is_table_shard(e):
                progress.update()

        for name, f, entries in zip(files, handles, plans):
            write_safetensors(out / name, entries, f.metadata(), written)
    (out / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if index is not None:
        index["metadata"] = {**index.get("metadata", {}), "total_size": sum(e.nbytes for plan in plans for e in plan)}
        index["weight_map"] = dict(sorted((e.name, name) for name, plan in zip(files, plans) for e in plan))
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for skipped in copy_other_files(src, out, files):
        print(f"quantize: not copying weight file {skipped} (pickle, or not in {INDEX})", file=sys.stderr)


def _summary(handles, plans: list[list[_Entry]], seconds: float) -> Summary:
    """The tables' bytes: every tensor's, before and after, less those copied as they are."""
    entries = [e for plan in plans for e in plan]
    shards = [e for e in entries if _is_table_shard(e)]
    source = sum(_nbytes(k, h.get_slice(k).get_dtype(), h.get_slice(k).get_shape()) for h in handles for k in h.keys())
    copied = sum(e.nbytes for e in entries if e.copied)
    tables, rows = len({_table_of(e.name) for e in shards}), sum(e.shape[0] for e in shards)
    return Summary(tables, rows, source - copied, sum(e.nbytes for e in entries) - copied, seconds)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, fmt: str = "int8") -> Summary:
    """Write the copy of checkpoint SRC with its PLE tables in `fmt` (INT8 or NVFP4) into DST (absent or empty)."""
    start = time.perf_counter()
    if fmt not in TARGETS:
        raise ValueError(f"PLE table format {fmt!r} is not one of {TARGETS}")
    src, dst = Path(src), Path(dst)
    if not (src / CONFIG).is_file():
        raise FileNotFoundError(f"{src} has no {CONFIG}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"DST {dst} exists and is not an empty folder; refusing to overwrite")
    files, index = weight_files(src)
    check_config(src)
    if not has_tokenizer(src):
        print(f"quantize: warning: {src} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); serving DST "
              "will need one (vLLM's --tokenizer)", file=sys.stderr)  # fmt: skip
    with ExitStack() as stack:
        handles = open_all(src, files, stack)
        config = _load_config(src, fmt, sorted({_table_of(k) for h in handles for k in h.keys() if is_ple_table(k)}))
        plans = _plan(src, handles, FORMATS[fmt])
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
        tmp.mkdir()
        try:
            _write(src, tmp, files, handles, plans, config, index)
            if dst.exists():
                dst.rmdir()  # empty, checked above
            os.replace(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return _summary(handles, plans, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m qwen4_exp_hcu.quantize",
        description="Quantize the PLE tables of a Qwen4Exp checkpoint to INT8 rows (compressed-tensors) or NVFP4.",
    )
    parser.add_argument("src", help="Hugging Face checkpoint folder (PLE tables in BF16, F32, F16, FP8 or NVFP4)")
    parser.add_argument("dst", help="output folder (must not exist, or be empty)")
    parser.add_argument("--format", choices=TARGETS, default="int8", help="the PLE tables' format in DST")
    args = parser.parse_args(argv)
    try:
        summary = quantize_checkpoint(args.src, args.dst, args.format)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(f"quantize: {summary} ({args.format}) -> {args.dst}")


if __name__ == "__main__":
    main()
