"""Where a checkpoint's tensors lie in its safetensors files (`CheckpointFiles`), and one table's owned rows in them,
memory-mapped and never read whole (`MappedShards`): what the file tier reads its rows from.

The safetensors format is an 8-byte little-endian header length, a JSON header, then the data. The safetensors
library reads tensors but does not say where they lie, which a row gather needs, so the header is read here; each
tensor's byte range is the header's own (`data_offsets`). Rows move as bytes (`byte_rows`): the file tier never
converts them, so lookups see exactly the checkpoint's.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class TensorLocation:
    path: Path
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    offset: int  # of the first byte in the file
    nbytes: int

    def rows(self) -> np.memmap:
        """[rows, bytes per row] read-only view of the file."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset, shape=(self.shape[0], self.nbytes // self.shape[0]))


class CheckpointFiles:
    """Where every tensor of a checkpoint directory's safetensors files lies: file, dtype, shape, byte range. A file
    the index names that is missing, or a file shorter than its header says, is an error naming it."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [directory / n for n in names]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"PLE rows from files: {missing[0]} (named by {index}) does not exist.")
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"PLE rows from files: no safetensors files in {directory}.")
        self.tensors: dict[str, TensorLocation] = {}
        for f in files:
            self.tensors.update(_read_header(f))
        self._by_key: dict[str, list[TensorLocation]] = {}
        for n, loc in self.tensors.items():
            self._by_key.setdefault(_key(n), []).append(loc)

    def find(self, name: str) -> TensorLocation:
        """The tensor `name`, matched from its `layers.` part on (vLLM and the checkpoint prefix models differently)."""
        hits = self._by_key.get(_key(name), [])
        if len(hits) != 1:
            raise ValueError(f"PLE rows from files: {name} is {'not' if not hits else 'more than once'} in the safetensors files of {self.directory}.")
        return hits[0]


def _key(name: str) -> str:
    return name[name.index("layers.") :] if "layers." in name else name


def _read_header(path: Path) -> dict[str, TensorLocation]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"PLE rows from files: {path} is truncated (no safetensors header).")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"PLE rows from files: {path} is truncated (header of {n} bytes, file of {size}).")
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if 8 + n + end > size:
            raise ValueError(f"PLE rows from files: {path} is truncated: {name} ends at byte {8 + n + end}, the file has {size}.")
        out[name] = TensorLocation(path, info["dtype"], tuple(info["shape"]), 8 + n + begin, end - begin)
    return out


IN_MEMORY_SHARE = 1 / 16
"""A table's parts whose rows are at most this share of its widest part's (an INT8 table's BF16 row scales: 2 bytes
beside 160) are read into host memory whole as their shard is added, not mapped: a scale page holds 2048 rows'
scales, so a table of tens of millions of rows spreads its misses over as many scale pages, and each missed row
would read one from the drive beside its weight row's. What they add to the host bytes beside the resident rows:
`file_rows.index_bytes`."""


def in_memory_parts(row_bytes: dict[str, int]) -> list[str]:
    """The parts (of `part -> bytes per row`) the file tier holds in host memory rather than reads from the files."""
    widest = max(row_bytes.values(), default=0)
    return [part for part, size in row_bytes.items() if size <= IN_MEMORY_SHARE * widest]


class MappedShards:
    """Owned rows `[start, start + n)` of a table whose checkpoint shards hold `shard_rows` rows each, per part
    (`weight`, `weight_scale`: `row_bytes` gives each part's bytes per row): memory-mapped from the files, or read
    whole into host memory (`in_memory_parts`). `src` holds their addresses by (shard, part) for the C host function
    (`stage.c`), `memory_mask` which parts are held in memory (bit i: part i)."""

    def __init__(self, files: CheckpointFiles, start: int, n: int, shard_rows: int, row_bytes: dict[str, int]) -> None:
        self.files, self.start, self.n, self.shard_rows, self.row_bytes = files, start, n, shard_rows, row_bytes
        self.first = start // shard_rows
        self.maps: dict[int, dict[str, np.ndarray]] = {}  # checkpoint shard -> part -> [shard rows, bytes]
        self.src = np.zeros((max(0, (start + n - 1) // shard_rows - self.first + 1), len(row_bytes)), dtype=np.uintp)
        self.in_memory = in_memory_parts(row_bytes)
        self.memory_mask = sum(1 << i for i, part in enumerate(row_bytes) if part in self.in_memory)

    def add(self, j: int, parts: dict[str, str]) -> None:
        """Map checkpoint shard `j`'s per-row tensors (`part -> tensor name`), or read them (`in_memory`); their rows
        must be the table's."""
        for part, name in parts.items():
            mm = self.files.find(name).rows()
            if mm.shape[1] != self.row_bytes[part]:
                raise ValueError(f"{name}: {mm.shape[1]} bytes per row in the file, the table stores {self.row_bytes[part]}.")
            rows = np.array(mm) if part in self.in_memory else mm  # one sequential read of the shard's part
            self.maps.setdefault(j, {})[part] = rows
            self.src[j - self.first, list(self.row_bytes).index(part)] = rows.ctypes.data

    def mapped(self, j: int) -> dict[str, np.memmap]:
        """Shard `j`'s parts read from the files (not those held in memory)."""
        return {part: m for part, m in self.maps[j].items() if part not in self.in_memory}

    def check_complete(self) -> None:
        """Every shard that holds owned rows is mapped, else an error naming the first that is not (the C host
        function would read through a null pointer)."""
        unmapped = np.flatnonzero((self.src == 0).any(axis=1))
        if unmapped.size:
            raise ValueError(f"PLE rows from files: checkpoint shard {self.first + int(unmapped[0])} of the table's rows "
                             f"was not found in {self.files.directory}.")  # fmt: skip

    def read(self, rows: np.ndarray, into: dict[str, np.ndarray], at: int = 0) -> None:
        """Copy owned rows from the files into rows `at...` of the per-part byte arrays `into` (each part it names).
        Rows in file order read one run per shard."""
        if not rows.size:
            return
        glob = rows + self.start
        shard = glob // self.shard_rows
        starts = np.flatnonzero(np.diff(shard, prepend=-1))  # one run of rows per checkpoint shard
        for a, b in zip(starts.tolist(), [*starts[1:].tolist(), rows.size]):
            j = int(shard[a])
            for part in into:
                np.take(self.maps[j][part], glob[a:b] - j * self.shard_rows, axis=0, out=into[part][at + a : at + b])


class MappedRows:
    """One per-row part (`weight`, `weight_scale`) of a table's owned rows as they lie in the files, looking like
    a host tensor of `like`'s dtype and row shape: indexing with row ids (`rows[ids]`, a host tensor) reads those
    rows. What a GPU hot-row cache in front of the file tier copies its newcomers from (`HotRows` takes it where it
    takes a host table)."""

    def __init__(self, shards: MappedShards, part: str, like: torch.Tensor) -> None:
        self._shards, self._part = shards, part
        self.shape, self.dtype, self.device = (shards.n, *like.shape[1:]), like.dtype, torch.device("cpu")

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows in `ids`' order, read in file order: the reader copies one run of rows per shard, so ids in
        count order (a hot-row refresh's) would cost a copy each (182 k rows: 386 ms, sorted 62 ms on a 2-core
        host, `bench_file_promotions`)."""
        ids = ids.reshape(-1).numpy()
        order = np.argsort(ids, kind="stable")
        read = torch.empty((ids.size, *self.shape[1:]), dtype=self.dtype)
        self._shards.read(ids[order], {self._part: byte_rows(read)})
        out = torch.empty_like(read)
        out[torch.from_numpy(order)] = read
        return out


def byte_rows(t: torch.Tensor) -> np.ndarray:
    """A host tensor's rows as a [rows, bytes per row] uint8 array over its memory (rows move as bytes; 0 rows too)."""
    return t.view(torch.uint8).view(len(t), math.prod(t.shape[1:]) * t.element_size()).numpy()
