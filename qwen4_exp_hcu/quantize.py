"""Quantize the PLE tables of a Qwen4Exp checkpoint (BF16, or upstream's FP8 / NVFP4 layouts, e.g. the FP8
release's) to INT8 rows, or to upstream's NVFP4 layout (4 bits + block scales: 72 B per row of 128 values
against INT8's 130).

    python -m qwen4_exp_hcu.quantize SRC DST [--format int8|nvfp4]

INT8: every `...ple_embedding.ngram_embedding.shard_{j}.weight` becomes int8 `weight` + bf16 `weight_scale`
in the same file; config.json gains a compressed-tensors PLE group, merged into the main model's
compressed-tensors `quantization_config` when it has one (kept as it is otherwise). NVFP4: every shard
becomes packed e2m1 `weight` + e4m3 `weight_scale`, and each table gets ONE fp32
`...ngram_embedding.weight_scale_2` (from a first pass over its shards), declared by the text config's
`ple_embedding_dtype: "nvfp4"` as upstream does. A main method that declared the tables FP8 (`fp8`'s
`modules_to_convert`, ModelOpt's `quantized_layers`) no longer does. Every other tensor is copied byte for byte. Tensors are streamed one at a time (the PLE tables alone are
~90 GiB in BF16), and the output is built in a temporary folder beside DST and renamed into place only
when complete.
"""

import argparse
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from compressed_tensors.utils.match import match_name
from safetensors import safe_open
from tqdm import tqdm

from qwen4_exp_hcu.names import SCALE_SUFFIX, TABLE_TARGET
from qwen4_exp_hcu.ple.formats import (
    NVFP4_BLOCK,
    dequantize_fp8_rows,
    dequantize_nvfp4_rows,
    nvfp4_tensor_scale,
    quantize_nvfp4_rows,
)
from qwen4_exp_hcu.ple.declaration import without_fp8_declarations
from qwen4_exp_hcu.ple.int8 import quantize_rows
from qwen4_exp_hcu.ple.int8_scheme import merge_ple_group

CONFIG = "config.json"
MODELOPT_CONFIG = "hf_quant_config.json"
INDEX = "model.safetensors.index.json"
# Weights in pickle formats would contradict (and could shadow) the quantized safetensors: never copied.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
_SOURCE_TABLE_DTYPES = ("BF16", "F32", "F8_E4M3", "U8")  # BF16/F32 rows, upstream's FP8 and NVFP4 layouts
FORMATS = ("int8", "nvfp4")


def is_ple_table(tensor_name: str) -> bool:
    """True for a PLE table shard's weight, judged by the same target the written config declares."""
    module, _, param = tensor_name.rpartition(".")
    return param == "weight" and ".shard_" in module and match_name(module, TABLE_TARGET)


def _scale_name(weight_name: str) -> str:
    return f"{weight_name.removesuffix('weight')}{SCALE_SUFFIX}"


def _table_of(shard_name: str) -> str:
    """`...ngram_embedding.shard_{j}.weight` -> `...ngram_embedding`: the table a shard belongs to."""
    return shard_name.rsplit(".shard_", 1)[0]


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's storage bytes, so copied tensors stay bit-identical whatever their dtype."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class _Entry:
    """One output tensor: header facts known up front, bytes produced only when written."""

    def __init__(self, name: str, dtype: str, shape: list[int], produce: Callable[[], torch.Tensor]):
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"{name}: safetensors dtype {dtype} is not supported by the quantizer")
        self.name, self.dtype, self.shape, self.produce = name, dtype, shape, produce
        self.nbytes = _DTYPE_BYTES[dtype] * int(torch.Size(shape).numel())


# upstream's one scale per FP8 / NVFP4 table, by its shards' dtype
_TABLE_SCALE = {"F8_E4M3": "weight_scale", "U8": "weight_scale_2"}


def _source_rows(f, name: str, source_scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """A PLE table shard as float rows: BF16/F32 as stored; upstream's FP8 (e4m3 + the table's `weight_scale`)
    and NVFP4 (packed e2m1 + e4m3 block `weight_scale` + the table's `weight_scale_2`) dequantized to BF16."""
    weight = f.get_tensor(name)
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_rows(weight, source_scales[_table_of(name)])
    if weight.dtype == torch.uint8:
        return dequantize_nvfp4_rows(weight, f.get_tensor(_scale_name(name)), source_scales[_table_of(name)])
    return weight


def _plan_file(
    f, progress: tqdm, source_scales: dict[str, torch.Tensor], tensor_scales: dict[str, torch.Tensor] | None, written: set[str]
) -> list[_Entry]:  # fmt: skip
    """Output tensors of one safetensors file; a PLE table expands to INT8 weight + bf16 row scale (or, with
    `tensor_scales` {table: fp32 scale}, NVFP4 packed weight + block scales, and the table's one scale in the
    file of its first shard; `written` tracks those), and the scales of an FP8/NVFP4 source table are dropped."""
    entries, keys = [], set(f.keys())
    dropped = {_scale_name(n) for n in keys if is_ple_table(n) and f.get_slice(n).get_dtype() == "U8"}
    dropped |= {f"{t}.{part}" for t in source_scales for part in _TABLE_SCALE.values()}
    for name in f.keys():
        sl = f.get_slice(name)
        dtype, shape = sl.get_dtype(), list(sl.get_shape())
        if name in dropped:
            continue
        if not is_ple_table(name):
            entries.append(_Entry(name, dtype, shape, lambda name=name: f.get_tensor(name)))
            continue
        if dtype not in _SOURCE_TABLE_DTYPES or len(shape) != 2:
            raise ValueError(f"{name}: expected a 2-D BF16/F32/FP8/NVFP4 PLE table, got {dtype} {shape} (already quantized?)")
        if dtype == "U8" and _scale_name(name) not in keys:
            raise ValueError(f"{_scale_name(name)}: missing beside its NVFP4 PLE table shard (expected in the same file)")
        width = shape[1] * (2 if dtype == "U8" else 1)
        stash: dict[str, torch.Tensor] = {}  # the scale waits here for the entry written right after its weight
        if tensor_scales is None:

            def weight(name=name, stash=stash):
                try:
                    q, stash["scale"] = quantize_rows(_source_rows(f, name, source_scales))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from e
                progress.update()
                return q

            entries.append(_Entry(name, "I8", [shape[0], width], weight))
            entries.append(_Entry(_scale_name(name), "BF16", [shape[0], 1], lambda stash=stash: stash.pop("scale")))
            continue
        if width % NVFP4_BLOCK:
            raise ValueError(f"{name}: NVFP4 rows hold blocks of {NVFP4_BLOCK} values; the row width {width} is not a multiple")
        table = _table_of(name)
        table_scale = tensor_scales[table]

        def packed(name=name, stash=stash, table_scale=table_scale):
            q, stash["scale"] = quantize_nvfp4_rows(_source_rows(f, name, source_scales), table_scale)
            progress.update()
            return q

        entries.append(_Entry(name, "U8", [shape[0], width // 2], packed))
        entries.append(_Entry(_scale_name(name), "F8_E4M3", [shape[0], width // NVFP4_BLOCK], lambda stash=stash: stash.pop("scale")))
        if table not in written:
            written.add(table)
            entries.append(_Entry(f"{table}.weight_scale_2", "F32", [1], lambda table_scale=table_scale: table_scale))
    return entries


def _write_safetensors(path: Path, entries: list[_Entry], metadata: dict[str, str] | None) -> None:
    """Stream tensors into a safetensors file: header from the plan, then each tensor's bytes in turn."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned, as safetensors itself does
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for e in entries:
            data = _raw_bytes(e.produce())
            if data.nbytes != e.nbytes:
                raise ValueError(f"{e.name}: produced {data.nbytes} bytes, planned {e.nbytes}")
            out.write(data)


def _weight_files(src: Path) -> tuple[list[str], dict | None]:
    """Safetensors files to convert (from the index when sharded) and the index itself."""
    index_path = src / INDEX
    if index_path.exists():
        index = json.loads(index_path.read_text())
        files = sorted(set(index["weight_map"].values()))
        missing = [n for n in files if not (src / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX} names files missing from SRC: {missing}")
        return files, index
    files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {src}")
    return files, None


def _load_config(src: Path, fmt: str, tables: list[str]) -> dict:
    """SRC's config declaring the tables in `fmt`: INT8 as our PLE group merged into its quantization config
    (kept as it is otherwise), NVFP4 as the text config's `ple_embedding_dtype`, upstream's marker. Earlier
    FP8 declarations of the tables are removed first."""
    config = json.loads((src / CONFIG).read_text())
    text = config.get("text_config") or config  # multimodal checkpoints nest the text model's config
    if "compression_config" in config or "quantization_config" in (config.get("text_config") or {}):
        raise ValueError(f"{src / CONFIG}: put the main model's quantization config at the top level as quantization_config")
    text.pop("ple_embedding_dtype", None)  # upstream's FP8/NVFP4 table marker, replaced below
    if config.get("quantization_config"):
        config["quantization_config"] = without_fp8_declarations(config["quantization_config"], tables)
    if fmt == "nvfp4":
        text["ple_embedding_dtype"] = "nvfp4"
        return config
    main = config.get("quantization_config")
    if main is None and (src / MODELOPT_CONFIG).is_file():  # ModelOpt <= 0.29 keeps it beside config.json
        main = json.loads((src / MODELOPT_CONFIG).read_text())  # as vLLM reads it when config.json has none
    try:
        config["quantization_config"] = merge_ple_group(main)
    except ValueError as e:
        raise ValueError(f"{src / CONFIG}: {e}") from None
    return config


def _table_names(src: Path, files: list[str]) -> list[str]:
    """The PLE tables of SRC (`...ple_embedding.ngram_embedding`), from the file headers."""
    names = set()
    for name in files:
        with safe_open(src / name, framework="pt") as f:
            names |= {_table_of(k) for k in f.keys() if is_ple_table(k)}
    return sorted(names)


def _copy_other_files(src: Path, dst: Path, weight_files: list[str]) -> Iterator[str]:
    """Copy tokenizer and other side files; yields the weight files left out (pickles, unindexed safetensors)."""
    for p in sorted(src.iterdir()):
        if p.name in (CONFIG, INDEX, *weight_files) or p.name.startswith("."):
            continue
        if p.suffix in _PICKLE_SUFFIXES or p.suffix == ".safetensors":
            yield p.name
        elif p.is_dir():
            shutil.copytree(p, dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)


def _table_scales(handles, source_scales) -> dict[str, torch.Tensor]:
    """NVFP4's one fp32 scale per table, from its largest magnitude over all its shards (a first pass)."""
    amax: dict[str, float] = {}
    for f in handles:
        for name in filter(is_ple_table, f.keys()):
            peak = _source_rows(f, name, source_scales).float().abs().max().item()
            amax[_table_of(name)] = max(amax.get(_table_of(name), 0.0), peak)
    return {table: nvfp4_tensor_scale(peak) for table, peak in amax.items()}


_OLD_LAYOUT = "an earlier qwen4_exp_hcu layout (a table scale per shard); quantize from the BF16 checkpoint instead"


def _source_table_scales(handles, dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """The one scale of each upstream FP8 / NVFP4 source table ({table: scale}), wherever its file; a missing
    one, or the old per-shard copies, is an error naming the tensor."""
    where = {k: h for h in handles for k in h.keys()}
    scales = {}
    for name in filter(is_ple_table, dtypes):
        dtype, table = dtypes[name], _table_of(name)
        if (dtype == "F8_E4M3" and _scale_name(name) in dtypes) or _scale_name(name) + "_2" in dtypes:
            raise ValueError(f"{_scale_name(name)}{'_2' if dtype == 'U8' else ''}: {_OLD_LAYOUT}")
        if dtype in _TABLE_SCALE and table not in scales:
            scale_name = f"{table}.{_TABLE_SCALE[dtype]}"
            if scale_name not in where:
                raise ValueError(f"{scale_name}: missing, the one scale of the {dtype} PLE table {table}")
            scales[table] = where[scale_name].get_tensor(scale_name)
    return scales


def _convert_weights(src: Path, files: list[str], out: Path, fmt: str) -> tuple[dict[str, str], int]:
    """Write each safetensors file of SRC, converted, into `out`; returns the new weight map and total bytes."""
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(src / n, framework="pt")) for n in files]
        names = [k for h in handles for k in h.keys()]
        scales = [n for n in names if n.endswith(f".{SCALE_SUFFIX}") and is_ple_table(n.removesuffix("_scale"))]
        dtypes = {k: h.get_slice(k).get_dtype() for h in handles for k in h.keys()}
        stray = [n for n in scales if dtypes.get(n.removesuffix("_scale")) not in ("F8_E4M3", "U8")]
        if stray:  # only upstream's NVFP4 tables come with per-shard scales to convert
            raise ValueError(f"{stray[0]}: SRC already holds quantized PLE tables")
        n_tables = sum(map(is_ple_table, names))
        if n_tables == 0:
            raise ValueError(f"no PLE tables (...ple_embedding.ngram_embedding.shard_j.weight) in {src}")
        source_scales = _source_table_scales(handles, dtypes)
        weight_map, total, written = {}, 0, set()
        tensor_scales = _table_scales(handles, source_scales) if fmt == "nvfp4" else None
        with tqdm(total=n_tables, desc="Quantizing PLE shards", unit="shard") as progress:
            for name, f in zip(files, handles):
                entries = _plan_file(f, progress, source_scales, tensor_scales, written)
                _write_safetensors(out / name, entries, f.metadata())
                weight_map.update({e.name: name for e in entries})
                total += sum(e.nbytes for e in entries)
    return weight_map, total


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, fmt: str = "int8") -> None:
    """Write the copy of checkpoint SRC with its PLE tables in `fmt` (INT8 or NVFP4) into DST (absent or empty)."""
    if fmt not in FORMATS:
        raise ValueError(f"PLE table format {fmt!r} is not one of {FORMATS}")
    src, dst = Path(src), Path(dst)
    if not (src / CONFIG).is_file():
        raise FileNotFoundError(f"{src} has no {CONFIG}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"DST {dst} exists and is not an empty folder; refusing to overwrite")
    files, index = _weight_files(src)
    config = _load_config(src, fmt, _table_names(src, files))

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    tmp.mkdir()
    try:
        weight_map, total = _convert_weights(src, files, tmp, fmt)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if index is not None:
            index["metadata"] = {**index.get("metadata", {}), "total_size": total}
            index["weight_map"] = dict(sorted(weight_map.items()))
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for skipped in _copy_other_files(src, tmp, files):
            print(f"quantize: not copying weight file {skipped} (pickle, or not in {INDEX})", file=sys.stderr)
        if dst.exists():
            dst.rmdir()  # empty, checked above
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m qwen4_exp_hcu.quantize",
        description="Quantize the PLE tables of a Qwen4Exp checkpoint to INT8 rows (compressed-tensors) or NVFP4.",
    )
    parser.add_argument("src", help="Hugging Face checkpoint folder (PLE tables in BF16, FP8 or NVFP4)")
    parser.add_argument("dst", help="output folder (must not exist, or be empty)")
    parser.add_argument("--format", choices=FORMATS, default="int8", help="the PLE tables' format in DST")
    args = parser.parse_args(argv)
    try:
        quantize_checkpoint(args.src, args.dst, args.format)
    except (ValueError, FileNotFoundError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
