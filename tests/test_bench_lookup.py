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


def test_rounds_are_one_or_more(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_lookup", "--rounds", "0"])
    with pytest.raises(SystemExit):
        bench_lookup.main()
    assert "--rounds" in capsys.readouterr().err


def test_each_format_table_is_measured_every_round_and_checked_once():
    """`--rounds 3`: each format's table built once, timed once a round per id source (each round keeps its own
    figure), its lookup checked against the torch reference once."""
    import argparse

    from benchmarks.common import token_streams

    timed = []

    def timer(fn):
        fn()
        timed.append(fn)
        return float(len(timed))

    args = argparse.Namespace(dim=128, tokens=2048, formats_table_gb=0.002, heads_per_ngram=8, rounds=3)
    rounds = bench_lookup.bench_formats(args, token_streams(2048, torch.Generator().manual_seed(0)), "cpu", timer)
    assert len(rounds) == 3 and len(timed) == 4 * 3 * 3
    figures = [gbs for r in rounds for row in r["formats"].values() for gbs in row["GB/s"].values()]
    assert len(set(figures)) == len(figures)  # no round copies another's figure
    for r in rounds:
        assert list(r["formats"]) == ["bf16", "int8", "fp8", "nvfp4"]
        assert all(row["exact"] == [True, True, True] for row in r["formats"].values())


@pytest.mark.gpu
def test_the_gpus_numa_node_is_read_from_its_pci_device():
    node = bench_lookup.gpu_numa_node()
    assert node is not None and node >= -1, torch.cuda.get_device_properties(0)
