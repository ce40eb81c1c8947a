"""Host memory of PLE tables: pinned for the accelerator (UVA), on 2 MiB pages (vLLM's `use_thp`), and shared
by the DP replicas on one node (vLLM's `dp_shared_memory`).

Huge pages: a table's private host memory is mapped on hugetlb pages when enough are reserved
(`vm.nr_hugepages`), else as transparent huge pages (`madvise`), else on ordinary pages with a warning.
They lift locality-friendly lookups over UVA (fewer IOMMU/TLB misses); uniform random reads do not change.

Sharing:
Every DP replica holds the same TP-sharded tables; with sharing, the node keeps one copy. Each table tensor
is one POSIX shared-memory file (`/dev/shm/{run}-{name}`): the sharing group's first rank creates it and
fills it from the checkpoint, every rank maps it (and registers the mapping for UVA), and the creator
unlinks the name as soon as all ranks have mapped it, so a later crash leaks nothing and the memory goes
when the last process exits. `run` is unique per serving run, so leftovers never collide.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
HUGE_PAGE = 2 << 20
MAP_HUGETLB = 0x40000  # Linux; Python's mmap module does not name it
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def pin(ptr: int, nbytes: int, owner) -> None:
    """Register host memory for the accelerator (UVA) until `owner` is freed."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"registering {nbytes} bytes of PLE table as pinned host memory failed: error {int(err)}, "
                           f"{cudart.cudaGetErrorString(err)}.")
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)  # runs before the memory is released


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """Host memory of exactly the table's size, page-locked and mapped for the accelerator (UVA).
    torch's pinned allocator rounds every block up to a power of two (a 12 GB table would take 16 GB),
    so the table registers an ordinary allocation instead, and unregisters it before it is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = np.empty(max(nbytes, 1), dtype=np.uint8)
    pin(buf.ctypes.data, buf.nbytes, buf)
    return torch.from_numpy(buf)[:nbytes].view(dtype).view(shape)


def _free_hugetlb_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1]) * HUGE_PAGE
    return 0


def _thp_possible() -> bool:
    return THP_SETTING.exists() and "[never]" not in THP_SETTING.read_text()


def huge_page_empty(shape, dtype: torch.dtype, name: str = "PLE table") -> tuple[torch.Tensor, str]:
    """A private host tensor on 2 MiB pages, and which pages it got: "hugetlb", "thp" or "4k" (no huge
    pages available: a warning). Pinned for UVA when an accelerator exists."""
    nbytes = max(torch.Size(shape).numel() * dtype.itemsize, 1)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping, kind = None, "hugetlb"
    if _free_hugetlb_bytes() >= size:
        try:
            mapping = mmap.mmap(-1, size, flags=flags | MAP_HUGETLB)
        except OSError:
            mapping = None
    if mapping is None:  # THP: map one page more, use the 2 MiB-aligned part
        mapping, kind = mmap.mmap(-1, size + HUGE_PAGE, flags=flags), "thp"
        if _thp_possible():
            mapping.madvise(mmap.MADV_HUGEPAGE)
        else:
            kind = "4k"
            logger.warning(
                "%s: --engram-config.use_thp asked for 2 MiB host pages, but no hugetlb pages are reserved "
                "(vm.nr_hugepages) and transparent huge pages are off (%s); using 4 KiB pages.", name, THP_SETTING
            )
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = (-tensor.data_ptr()) % HUGE_PAGE if kind != "hugetlb" else 0
    tensor = tensor[offset : offset + size]
    if torch.cuda.is_available():
        pin(tensor.data_ptr(), size, mapping)
    return tensor[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape), kind


class SharingGroup(Protocol):
    """The ranks that share one copy (vLLM's DP group `GroupCoordinator` satisfies it)."""

    rank_in_group: int

    def barrier(self) -> None: ...


class SharedHost:
    def __init__(self, group: SharingGroup, run: str):
        self.group, self.run = group, run
        self._mappings: list[mmap.mmap] = []

    @property
    def writer(self) -> bool:
        """Whether this rank fills the shared tables (the others only map them)."""
        return self.group.rank_in_group == 0

    def scoped(self, name: str) -> SharedHost:
        """The same group, with `name` added to every file name (one scope per table)."""
        return SharedHost(self.group, f"{self.run}-{name}")

    def empty(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor every rank of the group maps from the same memory (contents: the writer's)."""
        nbytes = max(torch.Size(shape).numel() * dtype.itemsize, 1)
        path = os.path.join(SHM_DIR, f"{self.run}-{name}")
        if self.writer:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, nbytes)
        self.group.barrier()  # created
        if not self.writer:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise RuntimeError(
                    f"--engram-config.dp_shared_memory: {path} made by the first DP replica is not visible here; "
                    "sharing needs the DP replicas on one node (turn it off for multi-node DP)."
                ) from None
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        os.close(fd)
        self.group.barrier()  # mapped everywhere
        if self.writer:
            os.unlink(path)
        self._mappings.append(mapping)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        if torch.cuda.is_available():  # every process registers its own mapping; the memory is counted once
            pin(tensor.data_ptr(), nbytes, mapping)
        return tensor[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)

    def loaded(self) -> None:
        """Every rank waits here until the writer has filled the tables."""
        self.group.barrier()
