"""dp_shared_memory: DP replicas on one node share one host copy of each PLE table.

The first rank of the sharing group creates and fills a /dev/shm file per table tensor; the others map it.
Checked on the CPU (3 gloo processes) and on 2 GPUs (one process per GPU, the tables read over UVA by the
fused kernel): every rank maps the same file (same name and inode in /proc/self/maps: one copy of the
memory on the node), only the first rank copies checkpoint rows, every rank's lookups and forward equal a
private (unshared) layer's bit for bit, and no file is left in /dev/shm once the tables exist (names are
unlinked as soon as every rank mapped them). On the GPU each process has also registered its mapping for
UVA (unregistering its table succeeds). Host bytes are measured on a 64 MiB shared tensor: every rank has
all of it resident (Rss), and the ranks' Pss add up to one copy. The same rows in a private host table (no
`dp_shared_memory`) cost every rank a whole copy: their Pss add up to `world` copies.
"""

import os
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from helpers.configs import tiny_text_config
from helpers.dist import init_process_group, spawn_workers, write_result
from helpers.layers import ple_state_dict
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.etp import TorchGroup
from qwen4_exp_hcu.ple.tiers.host_memory import SHM_DIR, SharedHost
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

MEASURED_BYTES = 64 << 20  # the shared tensor whose host bytes are measured


def _mappings(run: str) -> dict[str, dict]:
    """This process's mappings of the run's files (`/proc/self/smaps`): path -> inode, Rss and Pss in
    bytes. Pss splits each page among the processes that map it, so the ranks' Pss add up to the host
    bytes the shared memory takes on the node."""
    found, current = {}, None
    for line in open("/proc/self/smaps").read().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            ours = len(fields) > 5 and f"{run}-" in fields[5]
            current = found.setdefault(fields[5], {"inode": fields[4], "Rss": 0, "Pss": 0}) if ours else None
        elif current is not None and fields[0] in ("Rss:", "Pss:"):
            current[fields[0][:-1]] += int(fields[1]) * 1024
    return found


def _pss_over(tensor: torch.Tensor) -> int:
    """Pss in bytes of the mappings holding `tensor`'s bytes (`/proc/self/smaps`; a mapping merged with
    neighbours only adds to it)."""
    lo, hi, total, inside = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, 0, False
    for line in open("/proc/self/smaps").read().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            inside = start < hi and lo < end
        elif inside and fields[0] == "Pss:":
            total += int(fields[1]) * 1024
    return total


def _worker(rank, world, tmp, run, on_gpu):
    torch.set_num_threads(1)
    init_process_group("gloo", rank, world, tmp)
    dev = torch.device(f"cuda:{rank}" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.set_device(dev)
    cfg = tiny_text_config()
    sd = ple_state_dict(cfg, 1, True, seed=4)
    storage = PLEStorage("int8", dev, host=True)
    shared = PLELayer.from_state_dict(
        cfg, 1, sd, storage=replace(storage, shared=SharedHost(TorchGroup(), run)), dtype=torch.float32
    )
    private = PLELayer.from_state_dict(cfg, 1, sd, storage=storage, dtype=torch.float32)
    mappings = _mappings(run)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(rank)).to(dev)
    batch = PLEBatch.from_lengths(ids, [6, 3], [0, 1], [False, False])
    hs = torch.randn(9, cfg.hidden_size * cfg.hc_count, generator=torch.Generator().manual_seed(10 + rank)).to(dev)
    states = [PLEState.zeros(private.state_shapes(), 2, torch.float32, dev) for _ in range(2)]
    dist.barrier()
    weight, scale = shared.table.weight, shared.table.scale
    result = {
        "maps_shared_files": sorted(mappings),
        "inodes": sorted({m["inode"] for m in mappings.values()}),
        "host_resident": weight.device.type == "cpu" and scale.device.type == "cpu",
        "tables_equal": torch.equal(weight, private.table.weight) and torch.equal(scale, private.table.scale),
        "outputs_equal": torch.equal(shared.lookup(batch, states[0]), private.lookup(batch, states[1]))
        and torch.equal(shared(hs, batch, states[0]), private(hs, batch, states[1])),
    }
    # host bytes on the node, measured on a table-sized tensor (the tiny tables are a few pages)
    sized = SharedHost(TorchGroup(), f"{run}-sized").empty("rows", (MEASURED_BYTES,), torch.int8)
    if rank == 0:
        sized.fill_(1)
    dist.barrier()
    result["sized_ok"] = int(sized.sum()) == MEASURED_BYTES  # every rank reads every page
    dist.barrier()
    measured = _mappings(f"{run}-sized").values()
    result["rss"], result["pss"] = sum(m["Rss"] for m in measured), sum(m["Pss"] for m in measured)
    # the same bytes as a private host table (what each rank holds without dp_shared_memory)
    own = PLETable(MEASURED_BYTES // 128, 128, storage).weight
    own.fill_(1)
    result["private_pss"] = _pss_over(own)
    result["left_in_shm"] = sorted(f for f in os.listdir(SHM_DIR) if f.startswith(run))
    if on_gpu:  # registered: unregistering succeeds (then register again; no error is left behind)
        cudart = torch.cuda.cudart()
        result["registered"] = [
            int(cudart.cudaHostUnregister(t.data_ptr())) == 0 and int(cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0)) == 0
            for t in (weight, scale)
        ]
    dist.barrier()
    dist.destroy_process_group()
    write_result(tmp, rank, result)


def _check_one_copy(results, run):
    files = [f"{SHM_DIR}/{run}-ple1-{part}" for part in ("scale", "weight")]
    for r in results:
        assert r["maps_shared_files"] == files, r["maps_shared_files"]  # the same two files in every rank
        assert r["inodes"] == results[0]["inodes"] and len(r["inodes"]) == 2  # ... the same memory objects
        assert r["host_resident"] and r["tables_equal"] and r["outputs_equal"]
        assert r["left_in_shm"] == []  # unlinked once mapped: nothing to leak
        assert r["sized_ok"] and r["rss"] == MEASURED_BYTES  # every rank has the whole tensor mapped ...
    host = sum(r["pss"] for r in results)  # ... and the node holds it once (Pss is rounded to KiB per rank)
    private = sum(r["private_pss"] for r in results)
    print(f"SHM-HOST-BYTES {len(results)} ranks x {MEASURED_BYTES} B mapped: the node holds {host} B "
          f"(private tables: {private} B)")
    assert abs(host - MEASURED_BYTES) <= 1024 * len(results), host
    assert private >= len(results) * MEASURED_BYTES, private  # unshared: a whole copy per rank


def _run_name() -> str:
    return f"qwen4hcu-test-{os.getpid()}-{time.monotonic_ns()}"


def test_dp_replicas_share_one_host_copy(tmp_path):
    run = _run_name()
    _check_one_copy(spawn_workers(_worker, 3, tmp_path / "run", run, False), run)


@pytest.mark.multi_gpu
def test_dp_replicas_on_two_gpus_share_one_registered_host_copy(tmp_path):
    run = _run_name()
    results = spawn_workers(_worker, 2, tmp_path / "run", run, True, start_method="spawn")
    _check_one_copy(results, run)
    assert all(r["registered"] == [True, True] for r in results)
