"""A Hugging Face checkpoint folder as files, what the quantizer (`qwen4_exp_hcu.quantize`) reads and writes whatever
becomes of the tables: config.json checked as transformers (and so vLLM) will read it, the safetensors files listed
(from the index when sharded) and opened, one written by streaming its tensors, and the side files copied. A bad
input is a one-line error naming its file or setting. torch, transformers and safetensors are imported by the
functions that use them, so the quantizer's `--help` answers at once."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
MODELOPT_CONFIG = "hf_quant_config.json"
INDEX = "model.safetensors.index.json"
# Weights in pickle formats would contradict (and could shadow) the written safetensors: never copied.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Any of these lets transformers and vLLM build the checkpoint's tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def weight_files(src: Path) -> tuple[list[str], dict | None]:
    """Safetensors files to convert (from the index when sharded) and the index itself."""
    index_path = src / INDEX
    if index_path.exists():
        index = read_json(index_path)
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{index_path}: no weight_map")
        files = sorted(set(index["weight_map"].values()))
        missing = [n for n in files if not (src / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX} names files missing from SRC: {missing}")
        return files, index
    files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {src}")
    return files, None


def has_tokenizer(src: Path) -> bool:
    return any((src / name).is_file() for name in TOKENIZER_FILES)


def _check_ple_layers(path: Path, text: dict) -> None:
    """`ple_layer_ids` (1-based) must name `linear_attention` decoder layers, as transformers requires;
    checked here by name (transformers' own check does not name the settings) where config.json spells out
    the layers; transformers' defaults are checked by transformers."""
    ids, types = text.get("ple_layer_ids") or [], text.get("layer_types") or []
    count = text.get("num_hidden_layers", len(types) or None)
    if not isinstance(count, int):
        return  # transformers' default (or its complaint about the value) applies
    for layer_id in ids:
        if not isinstance(layer_id, int) or not 1 <= layer_id <= count:
            raise ValueError(f"{path}: ple_layer_ids: {layer_id!r} is not a layer in 1..num_hidden_layers ({count})")
        if layer_id <= len(types) and types[layer_id - 1] != "linear_attention":
            raise ValueError(
                f"{path}: ple_layer_ids: layer {layer_id} is {types[layer_id - 1]!r} in layer_types; PLE layers "
                "must be linear_attention layers"
            )


def check_config(src: Path) -> None:
    """SRC's config as transformers (and so vLLM) will read it when serving: a bad one fails now, not after
    the tables are converted. transformers' validation errors span lines; one is kept."""
    from transformers import AutoConfig

    path = src / CONFIG
    config = read_json(path)
    _check_ple_layers(path, config.get("text_config") or config)
    try:
        AutoConfig.from_pretrained(src)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, its strict-dataclass errors)
        raise ValueError(f"{path}: transformers rejects it: {' '.join(str(e).split())}") from None


def open_all(src: Path, files: list[str], stack: ExitStack) -> list:
    """Every file opened (safetensors reads the header and checks the file holds all the data it declares):
    a truncated or corrupt file is an error naming it."""
    from safetensors import SafetensorError, safe_open

    handles = []
    for name in files:
        try:
            handles.append(stack.enter_context(safe_open(src / name, framework="pt")))
        except SafetensorError as e:
            raise ValueError(f"{src / name}: unreadable safetensors file ({e})") from None
    return handles


def copy_other_files(src: Path, dst: Path, weight_files: list[str]) -> Iterator[str]:
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


class Planned(Protocol):
    """One tensor of a file to write: its header facts known up front, its bytes produced only when written."""

    name: str
    dtype: str  # safetensors' name, e.g. "BF16"
    shape: list[int]
    nbytes: int
    produce: Callable[[], torch.Tensor]


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's storage bytes, so copied tensors stay bit-identical whatever their dtype."""
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: Sequence[Planned], metadata: dict[str, str] | None,
                      written: Callable[[Planned], None]) -> None:  # fmt: skip
    """Stream tensors into a safetensors file: the header from the plan, then each tensor's bytes in turn (only one
    tensor is in memory at a time); `written` is told of each."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned, as safetensors itself does
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for t in tensors:
            data = _raw_bytes(t.produce())
            if data.nbytes != t.nbytes:
                raise ValueError(f"{t.name}: produced {data.nbytes} bytes, planned {t.nbytes}")
            out.write(data)
            written(t)
