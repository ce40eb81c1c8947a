"""What the benchmark scripts share: the PLE config with the real hash, the token streams, the file tier's table
on disk, CUDA-graph capture and timing, and the report files."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
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
