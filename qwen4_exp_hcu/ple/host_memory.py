"""Host memory of PLE tables shared by the DP replicas on one node (vLLM's `dp_shared_memory`).

Every DP replica holds the same TP-sharded tables; with sharing, the node keeps one copy. Each table tensor
is one POSIX shared-memory file (`/dev/shm/{run}-{name}`): the sharing group's first rank creates it and
fills it from the checkpoint, every rank maps it (and registers the mapping for UVA), and the creator
unlinks the name as soon as all ranks have mapped it, so a later crash leaks nothing and the memory goes
when the last process exits. `run` is unique per serving run, so leftovers never collide.
"""

from __future__ import annotations

import mmap
import os
from typing import Protocol

import torch

SHM_DIR = "/dev/shm"


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
            from qwen4_exp_hcu.ple.table import pin

            pin(tensor.data_ptr(), nbytes, mapping)
        return tensor[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)

    def loaded(self) -> None:
        """Every rank waits here until the writer has filled the tables."""
        self.group.barrier()
