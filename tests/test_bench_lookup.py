"""`benchmarks/bench_lookup.py`'s host facts and options: where the table's pages went (NUMA), and 2 MiB pages for the
one host copy the release's 52 GB TP1 table leaves room for: the two suspects when the 52 GB table reads slower
than a 13 GB one (docs/PERFORMANCE.md, the lookups' table)."""

import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_lookup


def test_numa_nodes_are_this_hosts_free_bytes():
    nodes = bench_lookup.numa_nodes()
    assert set(nodes) == {p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*")}
    total = sum(int(line.split()[-2]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:"))  # fmt: skip
    assert nodes and all(0 < free <= total for free in nodes.values())


def test_huge_pages_are_for_the_one_host_copy(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_lookup", "--huge-pages"])
    with pytest.raises(SystemExit):
        bench_lookup.main()
    assert "--huge-pages" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_gpus_numa_node_is_read_from_its_pci_device():
    node = bench_lookup.gpu_numa_node()
    assert node is not None and node >= -1, torch.cuda.get_device_properties(0)
