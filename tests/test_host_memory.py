"""dp_shared_memory: DP replicas on one node share one host copy of each PLE table (gloo processes on CPU).

The first rank of the sharing group creates and fills a /dev/shm file per table tensor; the others map it.
Checked: every rank maps the same file (its name shows in /proc/self/maps), only the first rank copies
checkpoint rows, every rank's lookups and forward equal a private (unshared) layer's bit for bit, and no
file is left in /dev/shm once the tables exist (names are unlinked as soon as every rank mapped them).
"""

import os
import time

import torch
import torch.distributed as dist

from dist_utils import init_process_group, random_ple_state_dict, spawn_workers, write_result
from ple_configs import tiny_text_config
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.etp import TorchGroup
from qwen4_exp_hcu.ple.host_memory import SHM_DIR, SharedHost
from qwen4_exp_hcu.ple.layer import PLELayer

WORLD = 3


def _worker(rank, world, tmp, run):
    torch.set_num_threads(1)
    init_process_group("gloo", rank, world, tmp)
    cfg = tiny_text_config()
    sd = random_ple_state_dict(cfg, 1, True, seed=4)
    shared = PLELayer.from_state_dict(
        cfg, 1, sd, table_format="int8", host_table=True, dtype=torch.float32, shared_host=SharedHost(TorchGroup(), run)
    )
    private = PLELayer.from_state_dict(cfg, 1, sd, table_format="int8", host_table=True, dtype=torch.float32)
    maps = open("/proc/self/maps").read()
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(rank))
    batch = PLEBatch.from_lengths(ids, [6, 3], [0, 1], [False, False])
    hs = torch.randn(9, cfg.hidden_size * cfg.hc_count, generator=torch.Generator().manual_seed(10 + rank))
    states = [PLEState.zeros(private.state_shapes(), 2, torch.float32) for _ in range(2)]
    dist.barrier()
    result = {
        "maps_shared_files": sorted({line.split()[-2] if line.endswith("(deleted)") else line.split()[-1]
                                     for line in maps.splitlines() if f"{run}-" in line}),  # fmt: skip
        "tables_equal": torch.equal(shared.table.weight, private.table.weight) and torch.equal(shared.table.scale, private.table.scale),
        "outputs_equal": torch.equal(shared.lookup(batch, states[0]), private.lookup(batch, states[1]))
        and torch.equal(shared(hs, batch, states[0]), private(hs, batch, states[1])),
        "left_in_shm": sorted(f for f in os.listdir(SHM_DIR) if f.startswith(run)),
    }
    dist.barrier()
    dist.destroy_process_group()
    write_result(tmp, rank, result)


def test_dp_replicas_share_one_host_copy(tmp_path):
    run = f"qwen4hcu-test-{os.getpid()}-{time.monotonic_ns()}"
    results = spawn_workers(_worker, WORLD, tmp_path / "run", run)
    files = [f"{SHM_DIR}/{run}-ple1-{part}" for part in ("scale", "weight")]
    for r in results:
        assert r["maps_shared_files"] == files, r["maps_shared_files"]  # the same two files in every rank
        assert r["tables_equal"] and r["outputs_equal"]
        assert r["left_in_shm"] == []  # unlinked once mapped: nothing to leak
