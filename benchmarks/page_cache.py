"""The page cache of the file tier's checkpoint files, for measurements whose misses read the drive: dropping what a
process has mapped, counting how many of a lookup's pages came from the drive, and the drive's own 4 KiB
random-read rate, the limit of reads that miss the cache.

`posix_fadvise(DONTNEED)` drops clean pages that no process maps: a page the file tier's maps have touched stays
cached while mapped. `drop_mapped` unmaps the maps' pages first (`madvise(MADV_DONTNEED)`: the next touch faults)
and then drops the files' pages (`common.drop_page_cache`, which flushes written pages first). A touch of a page
the cache does not hold is a major fault (`getrusage`), which reads the drive; around it the kernel reads a window
of neighbouring pages into the cache, unless the map says its reads are random (`read_around`).
"""

from __future__ import annotations

import mmap
import os
import resource
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import drop_page_cache
from qwen4_exp_hcu.ple.tiers.file_map import MappedShards

PAGE = mmap.PAGESIZE


def _maps(shards: MappedShards) -> list[np.memmap]:
    """The shards' maps of the files (not the parts the tier holds in memory)."""
    return [m for j in shards.maps for m in shards.mapped(j).values()]


def drop_mapped(*shards: MappedShards) -> None:
    """Forget every page of the shards' files: unmapped from this process (every table's maps of them: a page one
    still maps stays cached), then dropped from the page cache, so the next read of each row reads the drive.
    (`np.memmap` keeps its `mmap.mmap` as `_mmap`: madvise needs it.)"""
    maps = [m for s in shards for m in _maps(s)]
    for m in maps:
        m._mmap.madvise(mmap.MADV_DONTNEED)
    for path in {m.filename for m in maps}:
        drop_page_cache(path)


def read_around(shards: MappedShards, on: bool) -> None:
    """The kernel's read-around on the shards' maps: on (`MADV_NORMAL`, how the file tier maps them) a fault reads a
    window of neighbouring pages too; off (`MADV_RANDOM`) it reads only the page touched."""
    for m in _maps(shards):
        m._mmap.madvise(mmap.MADV_NORMAL if on else mmap.MADV_RANDOM)


def pages_needed(shards: MappedShards, rows: np.ndarray) -> int:
    """Distinct file pages that reading owned `rows` (each part read from the files) touches."""
    glob = np.unique(rows) + shards.start
    shard = glob // shards.shard_rows
    pages = 0
    for j in np.unique(shard).tolist():
        local = glob[shard == j] - j * shards.shard_rows
        for m in shards.mapped(j).values():
            first = m.offset + local * m.shape[1]
            pages += np.unique(np.concatenate([first // PAGE, (first + m.shape[1] - 1) // PAGE])).size
    return pages


class PreadvRows:
    """vLLM 0.34's `disk_offload` way of reading a step's rows (`Qwen4ExpPLEDiskOffloadEmbedding._read_rows`), over
    the same files as a file-tier table's maps: every distinct row of the step (it keeps none resident), sorted,
    `POSIX_FADV_WILLNEED` on each run of adjacent pages, then one `preadv` a row, one thread. It reads the parts the
    tier maps (the weight rows): vLLM's FP8 table, the one `disk_offload` serves, has rows as wide and no per-row
    scales. The reference the file tier's misses are read against, cold, on one machine."""

    def __init__(self, shards: MappedShards) -> None:
        self.shards = shards
        self.fds = {path: os.open(path, os.O_RDONLY) for path in {m.filename for m in _maps(shards)}}
        self.buf = {part: bytearray(size) for part, size in shards.row_bytes.items() if part not in shards.in_memory}

    def read(self, rows: np.ndarray, out: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Read every distinct owned row of `rows` (local ids), each part, into `out[part]` (`[rows, bytes]`, in
        the order returned) or a scratch row; returns the distinct rows, sorted."""
        glob = np.unique(rows) + self.shards.start
        shard = glob // self.shards.shard_rows
        for part, buf in self.buf.items():
            size = len(buf)
            fd = np.array([self.fds[self.shards.maps[j][part].filename] for j in shard.tolist()])
            start = np.array([self.shards.maps[j][part].offset for j in shard.tolist()]) + (glob - shard * self.shards.shard_rows) * size
            first, last = start // PAGE, (start + size - 1) // PAGE
            run = np.ones(first.size, dtype=bool)
            run[1:] = (first[1:] > last[:-1] + 1) | (fd[1:] != fd[:-1])
            for f, lo, hi in zip(fd[run].tolist(), first[run].tolist(), last[np.roll(run, -1)].tolist()):
                os.posix_fadvise(f, lo * PAGE, (hi - lo + 1) * PAGE, os.POSIX_FADV_WILLNEED)
            for i, (f, at) in enumerate(zip(fd.tolist(), start.tolist())):
                os.preadv(f, [buf if out is None else out[part][i]], at)
        return glob - self.shards.start

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@dataclass(frozen=True)
class IOCount:
    """This process's reads that reached the storage layer (`/proc/self/io` read_bytes: a fault's read-around
    included) and its major faults, every thread's (the file tier's host function runs on the driver's)."""

    read_bytes: int
    major_faults: int

    @classmethod
    def now(cls) -> IOCount:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return cls(int(fields["read_bytes"]), resource.getrusage(resource.RUSAGE_SELF).ru_majflt)

    def __sub__(self, other: IOCount) -> IOCount:
        return IOCount(self.read_bytes - other.read_bytes, self.major_faults - other.major_faults)


def cache_report(count: IOCount, pages: int) -> dict:
    """A phase's reads against the pages its misses touched: the touches without a major fault (`page_cache_hits`:
    the page cached, or its read asked for before the touch, so only `drive_read_bytes` tells a cold phase) and the
    drive bytes a needed byte cost."""
    hits = 1.0 - count.major_faults / pages if pages else 1.0
    return {"pages_needed": pages, "needed_bytes": pages * PAGE, "major_faults": count.major_faults,
            "drive_read_bytes": count.read_bytes, "page_cache_hits": min(1.0, max(0.0, hits))}  # fmt: skip


def _open_direct(path: str | Path) -> tuple[int, bool]:
    """`path` opened for reads that bypass the page cache (O_DIRECT), or, where the file system refuses it, with its
    cached pages dropped and read-ahead off."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        drop_page_cache(path)
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd, False


def random_read_rate(paths: Iterable[str | Path], reads: int = 4096, depth: int = 1, block: int = 4096,
                     seed: int = 0) -> dict:  # fmt: skip
    """The drive's random-read rate: `reads` reads of `block` bytes at random `block`-aligned offsets spread over
    the files, `depth` at a time (threads: `os.preadv` gives the GIL up), each into a page-aligned buffer (O_DIRECT
    needs one). IOPS and MB/s; `o_direct` False where the file system refused O_DIRECT (then the files' cache was
    dropped first, and blocks read twice may hit it)."""
    files = [(p, os.path.getsize(p) // block) for p in paths]
    files = [(p, n) for p, n in files if n]
    opened = [_open_direct(p) for p, _ in files]
    try:
        blocks = np.array([n for _, n in files])
        rng = np.random.default_rng(seed)
        which = rng.choice(len(files), reads, p=blocks / blocks.sum())
        offsets = (rng.random(reads) * blocks[which]).astype(np.int64) * block
        fds = [fd for fd, _ in opened]
        buffers = [mmap.mmap(-1, block) for _ in range(depth)]

        def worker(k: int) -> None:
            for f, o in zip(which[k::depth].tolist(), offsets[k::depth].tolist()):
                os.preadv(fds[f], [buffers[k]], o)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            list(pool.map(worker, range(depth)))
        took = time.perf_counter() - t0
    finally:
        for fd, _ in opened:
            os.close(fd)
    return {"reads": reads, "depth": depth, "block": block, "o_direct": all(d for _, d in opened),
            "bytes_spanned": int(blocks.sum()) * block, "s": took, "iops": reads / took,
            "mb_per_s": reads * block / took / 1e6}  # fmt: skip


def mapped_read_rate(paths: Iterable[str | Path], reads: int = 4096, prefetch: bool = False, seed: int = 0) -> dict:
    """Random pages of the files read through read-only maps with read-around off, their cache dropped first: each
    page a major fault in turn (what the file tier's host function does with a cold miss), or, with `prefetch`, every
    page asked for first (`MADV_WILLNEED`: the kernel queues all their reads at once) and then touched. Pages a
    second, the bytes read from the drive, and the major faults (none where the page's read was queued first)."""
    maps = []
    for p in paths:
        if size := os.path.getsize(p) // PAGE * PAGE:
            drop_page_cache(p)
            with open(p, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ))
            maps[-1].madvise(mmap.MADV_RANDOM)
    try:
        sizes = np.array([len(m) // PAGE for m in maps])
        rng = np.random.default_rng(seed)
        which = rng.choice(len(maps), reads, p=sizes / sizes.sum()).tolist()
        offsets = ((rng.random(reads) * sizes[which]).astype(np.int64) * PAGE).tolist()
        before, t0 = IOCount.now(), time.perf_counter()
        if prefetch:
            for w, o in zip(which, offsets):
                maps[w].madvise(mmap.MADV_WILLNEED, o, PAGE)
        sum(maps[w][o] for w, o in zip(which, offsets))
        took, count = time.perf_counter() - t0, IOCount.now() - before
    finally:
        for m in maps:
            m.close()
    return {"reads": reads, "prefetch": prefetch, "s": took, "pages_per_s": reads / took,
            "drive_read_bytes": count.read_bytes, "major_faults": count.major_faults}  # fmt: skip
