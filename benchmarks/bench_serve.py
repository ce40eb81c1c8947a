"""Serving throughput of one checkpoint in vLLM, every PLE table placement side by side, on one GPU.

A synthetic Qwen4Exp written by our own checkpoint writer (`qwen4_exp_hcu.tiny`) with the real per-layer
shapes (hidden 2048, hc 4, PLE 16 heads x 128 over a ~2 GB INT8 table) and a few layers/experts, served
by vLLM with its defaults (breakable CUDA graphs for Qwen4Exp) in one engine per variant, one after the other:
  host_int8          our class, INT8 tables in pinned host memory, lookup prefetched on a side stream
  host_int8_serial   the same, `QWEN4_EXP_HCU_PREFETCH=0` (lookup inside the PLE layer)
  host_int8_no_pdl   the same, `QWEN4_EXP_HCU_PDL=0` (hyper-connection kernels without programmatic dependent launch)
  host_int8_gemm_down host_int8 with the hyper-connections' down projection through the GEMM library and the silu
                     kernel at every batch (`QWEN4_EXP_HCU_TORCH_OPS=down_silu`), not `down_silu` at 1-16 tokens: where
                     the fused launch pays in serving (at 32 tokens the GEMM library is as fast in serving, though
                     the kernel sweep has the fused launch ahead: the model fuses up to 16)
  host_int8_down_launch host_int8 with the fused down GEMM's launch that `--down-silu` names (a label of
                     `bench_hyper_connection.py --sweep`, `QWEN4_EXP_HCU_DOWN_SILU`) at every batch it fuses: a sweep's
                     best served before it becomes the default
  gpu_int8           our class, INT8 tables in GPU memory (`--engram-config.cpu_offload=false`)
  host_fp8           our class, upstream's FP8 table layout (e4m3 rows + one table scale) in pinned host memory
  vllm_host_bf16     vLLM's own class (`QWEN4_EXP_HCU_DISABLE=1`), BF16 tables in host memory
  vllm_host_fp8      vLLM's own class, the same FP8 tables in host memory
  vllm_gpu_bf16      vLLM's own class, BF16 tables in GPU memory
  host_int8_mtp      host_int8 with MTP speculative decoding (3 draft tokens) from an `mtp.*` head that
                     follows the synthetic target (`tiny.add_mtp_head(follow_target=True)`: nearly every
                     draft accepted, so the ceiling of the speed-up; the acceptance rate is reported)
  host_int8_hot_rows host_int8 with a 1 GiB GPU hot-row cache filled from served traffic
  host_int8_files{100,50,20,5}  host_int8 with `host_table_gib` at 100/50/20/5 % of the table: the most-read
                     rows resident (from served traffic), the rest read from the checkpoint's files per lookup
                     (at 100 % every row is resident: the tier's own cost, the host round trip per lookup)
                     (`ple.file_rows`; the reads are host nodes of the decode step's full CUDA graph)
  host_int8_files{20,5}_calibrated  the same budgets from a calibrated start (`host_table_calibration`): the half of
                     benchmarks/data's text the prompts never take, then uniform token ids enough to name a row for
                     every slot (`calibration_tokens`), so the budget binds from the first step; the resident rows
                     stay put
  host_int8_sync, host_int8_files20_sync  host_int8 and host_int8_files20 with vLLM's async scheduling off: the
                     engine thread waits on the GPU, GIL released, instead of running the next step's Python (tells
                     whether the file tier's host function waits for the GIL)
  host_int8_piecewise host_int8 with cudagraph_mode PIECEWISE: decode steps are not one graph (what a PLE
                     read that a full graph cannot capture would cost)
Reported: decode tokens/s at batch 1/32/256 (`--batches`; after a 64-token prompt, 64 new tokens, from the engine's own
token timestamps: first to last token over the steps between them, so neither the prefill nor a request's fixed cost
enters; that cost, the run's wall time outside the engine's span from scheduling to the last token
(`fixed_time`), is reported as `decode_fixed_ms`, and the
wall-clock rate, 64 tokens minus the prefill-only run, as `decode_wall_tokens_per_s`; a batch the KV cache cannot
hold at once would decode in waves, which `decode_step` refuses and an engine's start-up probe catches first),
prefill tokens/s at 4k and 16k tokens (one prompt; from its scheduling to its first token, `prefill_time`, and by wall
clock as `prefill_wall_tokens_per_s`), GPU bytes of weights + tables, host table bytes, and what the
CUDA allocator holds once the engine is up (`--memory-only`: that alone, for every graph mode's check that
the GPU holds no copy of a host table).
A variant whose engine does not start is reported with its error. `--profile` adds, per variant and decode
batch, where a decode step's time goes: wall time per step against the GPU's busy time per step (CUDA
kernel time from torch.profiler) and the kernels that take most of it.

    python -m benchmarks.bench_serve [--variants host_int8 gpu_int8 ...] [--profile] [--out benchmarks/results]
        [--geometry release --table-gb 13] [--graph-mode full_decode_only] [--memory-only] [--prompts text] [--cold]
        [--cold-reads] [--rounds 2]

`--cold-reads` (the file-tier variants and vLLM's `vllm_disk_fp8`): before every timed run, decode and prefill, the
checkpoint's pages are forgotten (the tier's maps unmapped, then `posix_fadvise(DONTNEED)` on every checkpoint file:
`page_cache.drop_mapped`) and the maps' read-around is off, so a run's misses read the drive, each page once; each
decode batch reports the bytes its timed runs read from the drive and their major faults (`decode_reads`; the engine
runs in the worker's process).

`--prompts text`: prompts cut from natural English text (benchmarks/data/text_tokens.safetensors) instead of
uniform token ids, so prefill's PLE rows repeat as text's n-grams do (the file tier's resident rows serve them);
decode's ids are what the random model generates, uniform over the vocabulary. `--prompts text_followed`: the same
prompts, and each decodes the text that follows it (`follow_text.FollowText`, checked on every run), so decode
reads the rows text reads too. Several kinds: each in turn in each engine (one start per variant), reported as
`VARIANT@text`, `VARIANT@uniform`, ...

`--geometry release`: the release's per-layer shapes (census: hidden 2560, PLE 16 heads x 160, attention and
linear-attention heads, MoE widths), depth and experts cut, with a PLE table of `--table-gb` GB as INT8 (13: one
TP4 rank's share of the release's 52 GB table; 52: the whole table at TP1). `--layers 48`: the release's depth
(4 by default), where one PLE lookup per step weighs what it does in the release. `--indexer-budget 2048`: the
release's QSA budget, below `max_model_len`, so both classes run QSA attention (by default the budget is above it,
where our class runs dense attention, which equals QSA there, and vLLM's class runs QSA). `--graph-mode` (`GRAPH_MODES`):
vLLM's default breakable graphs, or `full_decode_only` (breakable off, `cudagraph_mode=FULL_DECODE_ONLY`: a decode
step is one graph and wall time tracks GPU time; decode speed ratios belong there, breakable graphs' wall clock
swings on this engine; without torch.compile, as vLLM's default for Qwen4Exp, whose breakable graphs turn it off,
and no compile at start: at 48 layers breakable engines, which skip it too, start in 134 s, compiled ones in 148-278
s), `full_decode_only_compiled` (the same with vLLM's torch.compile), torch.compile's `full_and_piecewise` / `piecewise`, or `eager`. vLLM's own class needs
the CuTe DSL on the GPU machine (`tools/gpu_cute_dsl.sh`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "host_int8": ({}, {}, "int8"),
    "host_int8_serial": ({"QWEN4_EXP_HCU_PREFETCH": "0"}, {}, "int8"),
    "host_int8_no_pdl": ({"QWEN4_EXP_HCU_PDL": "0"}, {}, "int8"),
    "host_int8_gemm_down": ({"QWEN4_EXP_HCU_TORCH_OPS": "down_silu"}, {}, "int8"),
    "host_int8_down_launch": ({}, {}, "int8"),  # the environment from --down-silu
    "gpu_int8": ({}, {"engram_config": {"cpu_offload": False}}, "int8"),
    "host_int8_mtp": ({}, {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}, "int8_mtp"),
    "host_int8_hot_rows": ({}, {"additional_config": {"qwen4_exp_hcu": {"hot_rows_gib": 1}}}, "int8"),
    # 100 %: a little over the table's bytes, so float rounding of the GiB setting cannot leave one row in the files
    **{f"host_int8_files{p}": ({}, {"host_table_share": p / 100 if p < 100 else 1.001}, "int8") for p in (100, 50, 20, 5)},
    **{f"host_int8_files{p}_calibrated": ({}, {"host_table_share": p / 100, "host_table_calibrated": True}, "int8")
       for p in (20, 5)},
    "host_int8_sync": ({}, {"async_scheduling": False}, "int8"),
    "host_int8_files20_sync": ({}, {"host_table_share": 0.2, "async_scheduling": False}, "int8"),
    "host_int8_piecewise": ({}, {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}, "int8"),
    "host_fp8": ({}, {}, "fp8"),
    # vLLM's GDN asserts a spelled-out output gate; transformers resolves an unset one to `hidden_act`.
    "vllm_host_bf16": ({"QWEN4_EXP_HCU_DISABLE": "1"}, {"hf_overrides": {"output_gate_type": "silu"}}, "bf16"),
    "vllm_host_fp8": ({"QWEN4_EXP_HCU_DISABLE": "1"}, {"hf_overrides": {"output_gate_type": "silu"}}, "fp8"),
    "vllm_gpu_bf16": (
        {"QWEN4_EXP_HCU_DISABLE": "1"},
        {"hf_overrides": {"output_gate_type": "silu"}, "engram_config": {"cpu_offload": False}},
        "bf16",
    ),
    # vLLM 0.34's disk tier: no table in memory, each step's rows read from the checkpoint's files
    "vllm_disk_fp8": (
        {"QWEN4_EXP_HCU_DISABLE": "1"},
        {"hf_overrides": {"output_gate_type": "silu"}, "engram_config": {"disk_offload": True}},
        "fp8",
    ),
}
# name: (environment, compilation_config entries, enforce_eager)
GRAPH_MODES = {
    "breakable": ({}, {}, False),  # vLLM's default for Qwen4Exp architectures
    "full_decode_only": ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}, False),
    "full_decode_only_compiled": ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, {"cudagraph_mode": "FULL_DECODE_ONLY"}, False),
    "full_and_piecewise": ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}, False),
    "piecewise": ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, {"mode": 3, "cudagraph_mode": "PIECEWISE"}, False),
    "eager": ({}, {}, True),
}  # fmt: skip
# Real per-layer shapes (hidden, hc, PLE head geometry); depth, experts and vocab cut to fit the time.
MODEL = dict(
    vocab_size=32000, hidden_size=2048, hc_count=4, hc_lowrank=32, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    num_attention_heads=16, num_key_value_heads=2, head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=16, num_experts_per_tok=4,
    ple_layer_ids=[2], ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=1_000_000, split_ngram_parts=64,
    indexer_head_dim=128, indexer_budget=32768, max_position_embeddings=32768,
)  # fmt: skip
def release_model(table_gb: float) -> dict:
    """The release's per-layer shapes (tests/data/census.json's text config), 4 layers and 16 experts, with an
    INT8 PLE table of `table_gb` GB: rows = table bytes / (160 + 2) over 16 heads."""
    heads, dim = 16, 160
    rows_per_head = int(table_gb * 1e9) // (dim + 2) // heads  # INT8 row + its bf16 scale
    return {**MODEL, **dict(
        hidden_size=2560, hc_lowrank=320, num_attention_heads=24, num_key_value_heads=2, head_dim=256,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
        moe_intermediate_size=640, shared_expert_intermediate_size=640, num_experts=16, num_experts_per_tok=10,
        heads_per_ngram=heads // 2, ple_embed_dim=heads * dim, ngram_vocab_size_base=rows_per_head,
        split_ngram_parts=128,
    )}  # fmt: skip


DECODE_BATCHES, DECODE_PROMPT, DECODE_TOKENS = (1, 32, 256), 64, 64
PREFILL_LENGTHS = (4096, 16384)
MAX_MODEL_LEN = 20480
REPEATS = 3
PROMPT_KINDS = ("uniform", "text", "text_followed")
FOLLOWED_TOKENS = 256  # the continuation a text_followed prompt carries: any decode here is shorter
ENGINE = dict(
    dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16384, max_num_seqs=256,
    enable_prefix_caching=False, kv_cache_memory_bytes=8 << 30, seed=0,  # 48 layers: RELEASE_KV_CACHE_BYTES
    attention_config={"backend": "TRITON_ATTN"}, additional_config={"gdn_prefill_backend": "triton"},
    compilation_config={"custom_ops": ["none"]},
)  # fmt: skip


def tensor_bytes(model) -> dict:
    """GPU bytes of every parameter/buffer plus PLE tables by device (tables are not parameters), the largest GPU
    tensors by name (where a class keeps a copy of a table, it shows), and our PLE tables' own accounts."""
    import torch

    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    on_gpu = {n: t.numel() * t.element_size() for n, t in named.items() if t.is_cuda}
    gpu = sum(on_gpu.values())
    tables = {"gpu": 0, "host": 0}
    described = []  # ours: each PLE table's own account (the file tier's: resident rows, its host function's time)
    from qwen4_exp_hcu.model.model import Qwen4ExpForCausalLM

    if isinstance(model, Qwen4ExpForCausalLM):
        for t in model.ple_table_reports():
            tables["host" if t["device"] == "cpu" else "gpu"] += t["bytes"]
            described.append(t["describe"])
    else:  # vLLM's own class keeps its tables as parameters or plain tensors: count what is on the host
        tables["host"] = sum(t.numel() * t.element_size() for t in named.values() if not t.is_cuda)
    return {"gpu_weights": gpu + tables["gpu"], "ple_gpu": tables["gpu"], "ple_host": tables["host"],
            "cuda_allocated": torch.cuda.memory_allocated(), "ple_tables": described,
            "largest_gpu_tensors": dict(sorted(on_gpu.items(), key=lambda kv: -kv[1])[:5])}  # fmt: skip


def decode_step(outputs) -> float:
    """Seconds per new token of a sequence (a decode step, without speculation) in one `generate` call, from the
    engine core's timestamps of each request's first and last token (`RequestOutput.metrics`, recorded with log
    stats on): the median over requests. Wall clock around the call also holds a request's fixed cost (measured on
    the H200: ~170 ms at one sequence, varying run to run), which swings a class's tokens/s by up to 10 %, and a
    slope between two lengths by up to 6 %."""
    steps = []
    for o in outputs:
        m = o.metrics
        if m is None or m.num_generation_tokens < 2:
            raise ValueError(f"request {o.request_id}: no token timestamps (log stats off, or fewer than 2 tokens)")
        steps.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
    first = max(outputs, key=lambda o: o.metrics.first_token_ts)
    last = min(outputs, key=lambda o: o.metrics.last_token_ts)
    if first.metrics.first_token_ts > last.metrics.last_token_ts:
        # the batch ran in waves (the KV cache held fewer sequences): a step's time is no longer a batch's step
        raise ValueError(f"the {len(outputs)} requests did not decode together: request {first.request_id}'s first "
                         f"token came after request {last.request_id}'s last; the KV cache holds fewer sequences "
                         "(raise kv_cache_memory_bytes)")  # fmt: skip
    return statistics.median(steps)


def prefill_time(outputs) -> float:
    """Seconds from a request's scheduling to its first token, vLLM's own `prefill_time` (engine-core timestamps):
    the median over requests. The wall clock around a one-token call also holds the work before scheduling, 3-6 %
    of it at 4k and 16k alike on the H200; the ±10 % a 4k prefill moves between engines is in both."""
    times = []
    for o in outputs:
        m = o.metrics
        if m is None or not m.scheduled_ts or not m.first_token_ts:
            raise ValueError(f"request {o.request_id}: no scheduling or first-token timestamp (log stats off?)")
        times.append(m.first_token_ts - m.scheduled_ts)
    return statistics.median(times)


PROFILE_TOKENS = 16  # decode steps profiled: CUDA kernels only, so 48 layers' events stay cheap to collect
IDLE_GAP_US = 20  # a GPU idle gap this long is a wait (on the host, a sync), not a launch's latency


def _timeline(events) -> tuple[float, dict[str, float], list[tuple[float, float, str, str]], float]:
    """µs with at least one GPU event running (intervals merged across streams), busy µs per stream, every idle
    gap between merged intervals as (µs from the first event to the gap's start, µs, the event before it, the
    event after it), and the span from the first event's start to the last one's end."""
    active, end, last, streams, gaps, first = 0.0, float("-inf"), "", {}, [], None
    for start, stop, stream, name in sorted((e.time_range.start, e.time_range.end, str(e.device_resource_id), e.name) for e in events):
        first = start if first is None else first
        streams[stream] = streams.get(stream, 0.0) + stop - start
        if start > end > float("-inf"):
            gaps.append((end - first, start - end, last, name))
        if stop > end:
            active, end, last = active + stop - max(start, end), stop, name
    return active, streams, gaps, 0.0 if first is None else end - first


def decode_gaps(gaps: list[tuple[float, float, str, str]], short_span: float) -> list[tuple[float, str, str]]:
    """The idle gaps of IDLE_GAP_US or more that start after the shorter run's span: those of the steps the longer
    run adds (the two runs' first steps are the same work; subtracting the shorter run's gap count instead can go
    negative, its gaps not matching the longer run's one for one)."""
    return [(us, before, after) for at, us, before, after in gaps if at >= short_span and us >= IDLE_GAP_US]


def profile_decode(llm, prompts, top: int = 12) -> dict:
    """Wall time per decode step (the engine's token timestamps, `decode_step`, of the profiled run) vs GPU-busy
    time and GPU events per decode step over PROFILE_TOKENS steps (the difference between requests of
    PROFILE_TOKENS and twice as many new tokens, so a request's prefill and fixed cost cancel), the kernels taking
    the most time, and those launched most often (what a class with more launches per step
    launches more of). GPU-active time (any stream running) splits wall - busy into idle GPU (wall - active) and
    overlap across streams (busy - active); the idle gaps say where the GPU waits (between steps: the host's
    step preparation; inside one: a sync)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def run(max_tokens):
        inputs, params = requests(prompts, max_tokens)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outputs = llm.generate(inputs, params, use_tqdm=False)
        kernels = {}  # name -> [us, events]
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                entry = kernels.setdefault(e.key, [0.0, 0])
                entry[0] += e.self_device_time_total
                entry[1] += e.count
        return decode_step(outputs), kernels, _timeline([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])

    _, k1, (active1, streams1, _, span1) = run(1 + PROFILE_TOKENS)
    step, k, (active, streams, gaps, _) = run(1 + 2 * PROFILE_TOKENS)
    waits = decode_gaps(gaps, span1)
    # per decode step: (us, events)
    decode = {name: ((t - k1.get(name, (0.0, 0))[0]) / PROFILE_TOKENS, (c - k1.get(name, (0.0, 0))[1]) / PROFILE_TOKENS)
              for name, (t, c) in k.items()}  # fmt: skip
    return {
        "wall_us_per_step": step * 1e6,  # the engine's token timestamps, as the decode rates (profiled)
        "gpu_busy_us_per_step": sum(us for us, _ in decode.values()),
        "gpu_active_us_per_step": (active - active1) / PROFILE_TOKENS,
        "busy_us_per_step_by_stream": {s: (us - streams1.get(s, 0.0)) / PROFILE_TOKENS for s, us in streams.items()},
        # where the GPU waits: idle gaps of IDLE_GAP_US or more per step, and the longest with their neighbours
        "idle_gaps_per_step": len(waits) / PROFILE_TOKENS,
        "idle_gap_us_per_step": sum(us for us, _, _ in waits) / PROFILE_TOKENS,
        "longest_idle_gaps": [[round(us, 1), before[:80], after[:80]] for us, before, after in sorted(waits, reverse=True)[:top]],
        "kernels_per_step": sum(c for _, c in decode.values()),  # GPU events (kernels, copies): small ones cost their launch
        "top_kernels_us_per_step": {n: us for n, (us, _) in sorted(decode.items(), key=lambda kv: -kv[1][0])[:top]},
        "most_launched_per_step": {n: [c, us] for n, (us, c) in sorted(decode.items(), key=lambda kv: -kv[1][1])[: 3 * top]},
    }


def calibration_tokens(slots: int, vocab_size: int, heads: int = 16):
    """A calibration stream naming a row for each of `slots` resident slots: the calibration part of benchmarks/data's
    text (`text_tokens`; its n-grams first: they repeat, so they count most), then uniform token ids, 2 x slots /
    `heads` of them: each names `heads` rows, nearly all distinct, so over a table of R rows they name
    R (1 - exp(-2 slots / R)) >= slots rows (slots <= R / 2)."""
    import torch

    text = text_tokens("calibration")
    filler = torch.randint(3, vocab_size, (-(-2 * slots // heads),), generator=torch.Generator().manual_seed(2))
    return torch.cat([text[text < vocab_size], filler])


PROMPT_TEXT = 100_000  # benchmarks/data's first ids give the prompts, the rest the calibration: no prompt is in it


def text_tokens(part: str):
    """benchmarks/data's natural English text (200 k ids below 30 522) cut in two: "prompts" (the first
    PROMPT_TEXT ids) and "calibration" (the rest), so a calibrated start has not seen the text it is timed on."""
    from safetensors.torch import load_file

    from benchmarks.common import TEXT_TOKENS

    text = load_file(TEXT_TOKENS)["tokens"].long()
    return text[:PROMPT_TEXT] if part == "prompts" else text[PROMPT_TEXT:]


def save_tokens(tokens, path: Path) -> None:
    """`tokens` as serving's calibration file: a safetensors file with one 1-D `tokens` tensor."""
    from safetensors.torch import save_file

    save_file({"tokens": tokens.contiguous()}, str(path))


def start_engine(variant: str, checkpoint: str, args: argparse.Namespace, vocab_size: int):
    """The variant's engine on `checkpoint` in the command line's graph mode, with log stats on (the token
    timestamps); returns it, its start-up seconds and the graph settings it resolved."""
    env, engine, _ = VARIANTS[variant]
    if variant == "host_int8_down_launch":
        env = {"QWEN4_EXP_HCU_DOWN_SILU": args.down_silu}
    mode_env, mode_compilation, eager = GRAPH_MODES[args.graph_mode]
    os.environ.update(env, **mode_env, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    engine = dict(engine)
    base = engine_config(args.layers)
    compilation_config = {**base["compilation_config"], **mode_compilation, **engine.pop("compilation_config", {})}
    from vllm import LLM

    t0 = time.monotonic()
    additional_config = {**base["additional_config"], **engine.get("additional_config", {})}
    calibrated = engine.pop("host_table_calibrated", False)
    if share := engine.pop("host_table_share", None):  # host_table_gib for that share of the checkpoint's tables
        from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles

        tables = {n: t for n, t in CheckpointFiles(checkpoint).tensors.items() if ".ngram_embedding." in n}
        ple = sum(t.nbytes for t in tables.values())
        additional_config["qwen4_exp_hcu"] = {"host_table_gib": share * ple / 2**30}
        if calibrated:
            rows = sum(t.shape[0] for n, t in tables.items() if n.endswith(".weight"))
            path = Path(checkpoint).parent / f"calibration_{share:g}.safetensors"
            save_tokens(calibration_tokens(int(share * rows), vocab_size), path)
            additional_config["qwen4_exp_hcu"]["host_table_calibration"] = str(path)
    if env.get("QWEN4_EXP_HCU_DISABLE"):
        from benchmarks.common import upstream_padding_shard_passes

        upstream_padding_shard_passes()
    if "text_followed" in args.prompts:
        from benchmarks.follow_text import FollowText

        engine["logits_processors"] = [FollowText]
    llm = LLM(model=checkpoint, **{**base, **engine, "additional_config": additional_config,
                                   "compilation_config": compilation_config}, enforce_eager=eager, disable_log_stats=False)  # fmt: skip
    startup = time.monotonic() - t0
    graphs = {"cudagraph_mode": llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name,
              "compilation_mode": llm.llm_engine.vllm_config.compilation_config.mode.name,
              "breakable": os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "1"}  # fmt: skip
    return llm, startup, graphs


def forget_file_pages(model) -> int:
    """`--cold-reads`: every file-tier table's pages forgotten (`page_cache.drop_mapped`) and its maps' read-around
    off, so the next run's misses read the drive, each page once; returns how many tables it found. (vLLM's
    `disk_offload` maps nothing: `forget_checkpoint_pages` drops its files' pages.)"""
    import torch

    from benchmarks.page_cache import drop_mapped, read_around

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # no host function reads the maps meanwhile
    tiers = [b.layer.table.file_rows for b in getattr(getattr(model, "model", None), "ple_blocks", [])]
    tiers = [t for t in tiers if t is not None]
    for t in tiers:
        read_around(t.shards, False)
        drop_mapped(t.shards)
    return len(tiers)


def forget_checkpoint_pages(llm, checkpoint: str) -> None:
    """`--cold-reads` for any class: the file tier's maps dropped (`forget_file_pages`), then every page of the
    checkpoint's files (vLLM's `disk_offload` reads them with `preadv`)."""
    from benchmarks.common import drop_page_cache

    llm.apply_model(forget_file_pages)
    for f in Path(checkpoint).glob("*.safetensors"):
        drop_page_cache(f)


def fixed_time(wall: float, outputs) -> float:
    """Seconds of one `generate` call outside the engine's span from its first request's scheduling to its last
    token: the requests' fixed cost (before scheduling, after the last token). Both from the same run, so never
    below zero, unlike a difference of two runs' wall times."""
    span = max(o.metrics.last_token_ts for o in outputs) - min(o.metrics.scheduled_ts for o in outputs)
    return wall - span


def timed(llm, prompts, max_tokens, repeats=REPEATS, cold: str | None = None, reads: list | None = None) -> tuple[float, float | None, float, float]:
    """Median wall time of `repeats` runs, their median seconds per decode step (`decode_step`; None for
    one-token requests), their median prefill seconds (`prefill_time`) and their median fixed seconds
    (`fixed_time`). `cold`: the checkpoint whose pages are
    forgotten before each run (`forget_checkpoint_pages`, untimed); `reads` gets each run's drive reads
    (`page_cache.IOCount`)."""
    import torch

    from benchmarks.page_cache import IOCount

    inputs, params = requests(prompts, max_tokens)
    times, steps, prefills, fixed = [], [], [], []
    for _ in range(repeats):
        if cold:
            forget_checkpoint_pages(llm, cold)
        torch.cuda.synchronize()
        t, before = time.perf_counter(), IOCount.now()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        check_followed(prompts, outputs)
        if reads is not None:
            reads.append(IOCount.now() - before)
        prefills.append(prefill_time(outputs))
        fixed.append(fixed_time(times[-1], outputs))
        if max_tokens > 1:
            steps.append(decode_step(outputs))
    return (statistics.median(times), statistics.median(steps) if steps else None, statistics.median(prefills),
            statistics.median(fixed))


def measure_decode(llm, prompt, args: argparse.Namespace) -> tuple[dict, dict]:
    """Per decode batch: tokens/s from the token timestamps and by wall clock, and the fixed ms per request the wall
    clock holds besides; with `--cold-reads` the drive reads of its timed runs; and with `--profile` where a step's
    time goes (`profile_decode`)."""
    decode, wall_rate, fixed, profiles, drive = {}, {}, {}, {}, {}
    cold = args.checkpoint if args.cold_reads else None
    for b in args.batches:
        prompts = [prompt(DECODE_PROMPT) for _ in range(b)]
        timed(llm, prompts, 1 + DECODE_TOKENS, repeats=1)  # warm-up: breakable graphs are captured at a batch size's first use
        prefill_only = timed(llm, prompts, 1, cold=cold)[0]
        reads = []
        wall, step, _, fixed_s = timed(llm, prompts, 1 + DECODE_TOKENS, cold=cold, reads=reads)
        decode[b], wall_rate[b], fixed[b] = b / step, b * DECODE_TOKENS / (wall - prefill_only), fixed_s * 1e3
        drive[b] = {"runs": len(reads), "drive_read_bytes": sum(r.read_bytes for r in reads),
                    "major_faults": sum(r.major_faults for r in reads)}  # fmt: skip
        if args.profile:
            profiles[b] = profile_decode(llm, prompts)
    return {"decode_tokens_per_s": decode, "decode_wall_tokens_per_s": wall_rate, "decode_fixed_ms": fixed,
            "decode_reads": drive}, profiles  # fmt: skip


def measure_prefill(llm, prompt, cold: str | None = None) -> dict:
    """Per prompt length: tokens/s from scheduling to the first token (`prefill_time`) and by wall clock; `cold`
    (`--cold-reads`): the checkpoint whose pages are forgotten before each timed run."""
    prefill, prefill_wall = {}, {}
    for n in PREFILL_LENGTHS:
        timed(llm, [prompt(n)], 1, repeats=1)  # warm-up
        wall, _, engine_s, _ = timed(llm, [prompt(n)], 1, cold=cold)
        prefill[n], prefill_wall[n] = n / engine_s, n / wall
    return {"prefill_tokens_per_s": prefill, "prefill_wall_tokens_per_s": prefill_wall}


def worker(variant: str, checkpoint: str, out: str, args: argparse.Namespace, vocab_size: int) -> None:
    """One variant's engine: its measurements into `out` (JSON). `args`: the command line's graph mode,
    `--profile`, `--memory-only`, `--prompts`."""
    llm, startup, graphs = start_engine(variant, checkpoint, args, vocab_size)  # the environment first: vLLM reads it on import
    import torch

    if args.memory_only:
        result = {"variant": variant, "startup_s": startup, "bytes": llm.apply_model(tensor_bytes)[0], **graphs}
        Path(out).write_text(json.dumps({"any": result}))
        os._exit(0)
    gen = torch.Generator().manual_seed(0)
    results = {}
    probe = prompt_source(args.prompts[0], vocab_size, torch.Generator().manual_seed(1))
    timed(llm, [probe(DECODE_PROMPT) for _ in range(max(args.batches))], 3, repeats=1)  # the largest batch decodes as one
    for kind in args.prompts:  # one engine, each prompt source in turn (the file tier's rows follow the traffic)
        prompt = prompt_source(kind, vocab_size, gen)
        decode, profiles = measure_decode(llm, prompt, args)
        results[kind] = {
            "variant": variant, "prompts": kind, "repeats": REPEATS, "startup_s": startup, **decode,
            **measure_prefill(llm, prompt, args.checkpoint if args.cold_reads else None),
            "bytes": llm.apply_model(tensor_bytes)[0], **graphs,
            **spec_decode_counters(llm), **({"decode_profile": profiles} if args.profile else {}),
        }  # fmt: skip
        Path(out).write_text(json.dumps(results))  # after each source: a cut-off run keeps what it measured
    os._exit(0)  # skip vLLM's interpreter teardown


class Followed(list):
    """A prompt's token ids, with the text that follows them: its decode writes that (`extra_args`, read by
    `follow_text.FollowText`)."""

    def __init__(self, ids: list[int], follow: list[int]):
        from benchmarks.follow_text import follow_args

        super().__init__(ids)
        self.extra_args = follow_args(follow)


def prompt_source(kind: str, vocab_size: int, gen):
    """n -> a prompt of n token ids: uniform ids in [3, vocab), or consecutive slices of natural English text
    (the prompt part of `text_tokens`, taken in order and wrapped); text_followed:
    the text's slices as `Followed` prompts, with the FOLLOWED_TOKENS after each, which no other prompt takes."""
    import torch

    if kind == "uniform":
        return lambda n: torch.randint(3, vocab_size, (n,), generator=gen).tolist()
    text = text_tokens("prompts")
    assert int(text.max()) < vocab_size, "the text's token ids must fit the model's vocab"
    at = [0]

    def span(start: int, n: int) -> list[int]:
        return text[(torch.arange(n) + start) % text.numel()].tolist()

    def take(n: int) -> list[int]:
        follow = FOLLOWED_TOKENS if kind == "text_followed" else 0
        # the next prompt starts after this one's continuation: a request decodes no text another has just prefilled
        start, at[0] = at[0], (at[0] + n + follow) % text.numel()
        return Followed(span(start, n), span(start + n, follow)) if follow else span(start, n)

    return take


def requests(prompts, max_tokens: int) -> tuple[list[dict], list]:
    """`llm.generate`'s prompts and their sampling params: greedy, EOS ignored, a `Followed` prompt's to follow."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                             extra_args=getattr(p, "extra_args", None)) for p in prompts]  # fmt: skip
    return [{"prompt_token_ids": list(p)} for p in prompts], params


def check_followed(prompts, outputs) -> None:
    """A `Followed` prompt's output is its text's continuation, or the engine did not apply `FollowText`."""
    for p, o in zip(prompts, outputs):
        tokens = list(o.outputs[0].token_ids)
        if (extra := getattr(p, "extra_args", None)) and tokens != extra["follow"][: len(tokens)]:
            raise RuntimeError("a text_followed prompt's decode did not follow its text: FollowText was not applied")


def spec_decode_counters(llm) -> dict:
    """Drafts and accepted drafts over the whole run (empty without speculation)."""
    c = {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
         if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}  # fmt: skip
    if not c.get("num_draft_tokens"):
        return {}
    return {"spec_decode": {**c, "acceptance_rate": c["num_accepted_tokens"] / c["num_draft_tokens"]}}


SMALL_TABLE_BASE = 1000  # rows per head of the tables written through transformers (then grown, `grow_tables`)
SMALL_LAYERS = 4  # decoder layers written through transformers (then repeated to the model's depth, `grow_tables`)
KIND_FORMATS = {"int8": "int8", "int8_mtp": "int8", "bf16": "bf16", "fp8": "fp8"}  # each checkpoint's table format


def write_checkpoints(workdir: Path, model: dict, kinds: set[str]) -> dict[str, Path]:
    """Checkpoint by kind (those `kinds` asks for): int8, int8 with an MTP head, bf16, fp8 (upstream's FP8 table
    layout). Each is written through transformers with 4 layers and small PLE tables (transformers would build a
    multi-GB table and 48 layers in fp32 first), then grows to the model's depth and table size (`grow_tables`);
    the kinds share one copy of the decoder layers' files (hard links), so a release-depth run fits on the disk."""
    import shutil

    from qwen4_exp_hcu.tiny import add_mtp_head, make_tiny_int8_checkpoint

    small = workdir / "small"
    small_int8, small_mtp = small / "int8", small / "int8-mtp"
    small_bf16 = small_int8.with_name(f"{small_int8.name}-bf16")
    if not (small_int8 / "config.json").exists():
        make_tiny_int8_checkpoint(small_int8, **{**model, **depth(SMALL_LAYERS), "ngram_vocab_size_base": SMALL_TABLE_BASE})
    if "int8_mtp" in kinds and not (small_mtp / "config.json").exists():
        add_mtp_head(shutil.copytree(small_int8, small_mtp, dirs_exist_ok=True), follow_target=True)
    sources = {"int8": small_int8, "int8_mtp": small_mtp, "bf16": small_bf16, "fp8": small_bf16}
    out = {kind: workdir / f"bench-{kind}" for kind in sources}
    for kind in kinds:
        if not (out[kind] / "config.json").exists():
            grow_tables(sources[kind], out[kind], model, workdir / "layers", KIND_FORMATS[kind])
    return out


def depth(layers: int) -> dict:
    """`layers` decoder layers in the release's pattern: three GDN layers, then one attention layer."""
    return {"num_hidden_layers": layers, "layer_types": [MODEL["layer_types"][i % 4] for i in range(layers)]}


def grow_tables(src: Path, dst: Path, model: dict, layers_dir: Path, fmt: str) -> None:
    """SRC (SMALL_LAYERS layers, small PLE tables) grown to `model`'s depth and PLE table size, its tables in `fmt`.

    Decoder layer i is SRC's layer i % 4 (the PLE module only in the PLE layer), written once per workdir into
    `layers_dir` (one file per layer) and hard-linked into DST. The PLE tables are the package's random tables of
    the grown config (`tiny.write_random_tables`: a file per shard, written one at a time, so a table of many GB
    never sits in memory whole). SRC's config declares an INT8 table already (the quantizer wrote it); a format
    upstream names (FP8: e4m3 rows and one table scale, as the FP8 release stores it) is declared by the config's
    `ple_embedding_dtype`."""
    from safetensors.torch import save_file

    from qwen4_exp_hcu.tiny import write_random_tables

    text = grown_config(src, dst, model, fmt)
    copy_side_files(src, dst)
    top, by_layer = small_tensors(src)
    weight_map = link_layers(by_layer, text, dst, layers_dir)
    weight_map.update(write_random_tables(dst, text, fmt))
    save_file(top, str(dst / "model.safetensors"), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(top, "model.safetensors"))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def grown_config(src: Path, dst: Path, model: dict, fmt: str):
    """DST's config.json: SRC's at `model`'s depth and table size, declaring `fmt` where upstream names it; returns
    its text config."""
    from qwen4_exp_hcu.ple.formats.rows import FORMATS
    from qwen4_exp_hcu.tiny import load_config

    dst.mkdir(parents=True, exist_ok=True)
    config = {**json.loads((src / "config.json").read_text()), **depth(model["num_hidden_layers"]),
              "ngram_vocab_size_base": model["ngram_vocab_size_base"]}  # fmt: skip
    if FORMATS[fmt].upstream_dtype:
        config["ple_embedding_dtype"] = FORMATS[fmt].upstream_dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return load_config(dst / "config.json")


def copy_side_files(src: Path, dst: Path) -> None:
    """SRC's files besides the weights, the config and the index (the tokenizer's, the generation config)."""
    import shutil

    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)


def small_tensors(src: Path) -> tuple[dict, dict[int, dict]]:
    """SRC's tensors outside the decoder layers, and each decoder layer's by its name within the layer; the PLE
    tables and hash buffers left out (the grown tables replace them)."""
    import re

    from safetensors import safe_open

    top, by_layer = {}, {}
    layer_name = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
    for f in src.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                if m := layer_name.match(k):
                    if ".ple_embedding." not in k:
                        by_layer.setdefault(int(m[1]), {})[m[2]] = st.get_tensor(k)
                else:
                    top[k] = st.get_tensor(k)
    assert sorted(by_layer) == list(range(SMALL_LAYERS)), f"{src}: expected {SMALL_LAYERS} decoder layers"
    return top, by_layer


def link_layers(by_layer: dict[int, dict], text, dst: Path, layers_dir: Path) -> dict[str, str]:
    """Decoder layer i of DST as SRC's layer i % SMALL_LAYERS (its PLE module only where `text` puts one), one file
    per layer written once into `layers_dir` and hard-linked into DST (every kind shares them); {tensor: file}."""
    from safetensors.torch import save_file

    from qwen4_exp_hcu.names import ple_layers

    ple = {layer.decoder for layer in ple_layers(text)}
    layers_dir.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(text.num_hidden_layers):
        tensors = {f"model.layers.{i}.{k}": t.clone() for k, t in by_layer[i % SMALL_LAYERS].items()
                   if i in ple or not k.startswith("ple.")}  # fmt: skip
        file = f"layer-{i:03d}.safetensors"
        if not (layers_dir / file).exists():
            save_file(tensors, str(layers_dir / f"{file}.part"), metadata={"format": "pt"})
            (layers_dir / f"{file}.part").rename(layers_dir / file)
        (dst / file).unlink(missing_ok=True)
        os.link(layers_dir / file, dst / file)
        weight_map.update(dict.fromkeys(tensors, file))
    return weight_map


def versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "vllm", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return out


def plot(results: dict, path: Path, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: r for k, r in results.items() if "decode_tokens_per_s" in r}  # not failed, not `--memory-only`
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(ok), 1)
    batches = sorted({int(b) for r in ok.values() for b in r["decode_tokens_per_s"]})
    for ax, key, groups, title in (
        (axes[0], "decode_tokens_per_s", batches, "decode tokens/s by batch"),
        (axes[1], "prefill_tokens_per_s", PREFILL_LENGTHS, "prefill tokens/s by prompt length"),
    ):
        for i, (name, r) in enumerate(ok.items()):
            ax.bar([g + i * width for g in range(len(groups))], [r[key].get(str(g), 0) for g in groups], width, label=name)
        ax.set_xticks([g + width * (len(ok) - 1) / 2 for g in range(len(groups))], [str(g) for g in groups])
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"vLLM serving, one H200: PLE table placements; {caption}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def describe(model: dict, graph_mode: str) -> str:
    return (f"hidden {model['hidden_size']}, {model['num_hidden_layers']} layers, "
            f"{model['ngram_vocab_size_base']:,} PLE rows per hash head, {graph_mode}")


def decode_ratios(results: dict) -> dict:
    """Ours against each reference measured on the same prompts in the same round: keys VARIANT[@SOURCE][@cold][#ROUND]
    -> {"KEY/REF_KEY": {batch: ratio}}."""
    ours = ("host_int8", "host_int8_serial", "host_int8_gemm_down", "host_int8_down_launch", "host_int8_mtp", "host_int8_hot_rows", "host_fp8",
            *(f"host_int8_files{p}" for p in (100, 50, 20, 5)), "host_int8_files20_sync",
            *(f"host_int8_files{p}_calibrated" for p in (20, 5)))  # fmt: skip
    ratios = {}
    for key in results:
        name, at, kind = key.partition("#")[0].partition("@")
        if name not in ours:
            continue
        for ref in ("host_int8", "host_int8_sync", "host_int8_piecewise", "gpu_int8", "vllm_host_bf16", "vllm_host_fp8", "vllm_gpu_bf16",
                    "vllm_disk_fp8"):
            ref += key[len(name):]
            if key != ref and all("decode_tokens_per_s" in results.get(k, {}) for k in (key, ref)):
                ours_rate, ref_rate = results[key]["decode_tokens_per_s"], results[ref]["decode_tokens_per_s"]
                ratios[f"{key}/{ref}"] = {int(b): ours_rate[b] / ref_rate[b] for b in ours_rate if b in ref_rate}
    return ratios


def ratio_rounds(ratios: dict) -> dict:
    """Each ratio measured in more than one round (`--rounds`): its rounds' (min, median, max) per batch, the spread
    between engine starts that a single ratio hides (±30 % for wall clock in breakable graphs)."""
    by_pair = {}
    for pair, r in ratios.items():
        by_pair.setdefault("/".join(k.partition("#")[0] for k in pair.split("/")), []).append(r)
    spread = lambda v: (min(v), statistics.median(v), max(v))  # noqa: E731
    return {pair: {b: spread([r[b] for r in rs]) for b in rs[0]} for pair, rs in by_pair.items() if len(rs) > 1}


def drive_rate(checkpoints: list[Path], reads: int = 8192) -> dict:
    """The drive's own 4 KiB random-read rate over the checkpoints' files, one read in flight (a fault's) and 16
    (`page_cache.random_read_rate`, O_DIRECT): the limit `--cold-reads` runs are read against."""
    from benchmarks.page_cache import random_read_rate

    files = sorted(f for c in checkpoints for f in Path(c).glob("*.safetensors"))
    return {f"qd{depth}": random_read_rate(files, reads, depth) for depth in (1, 16)}


def write_results(results: dict, out: Path, model: dict, graph_mode: str, drive: dict | None = None) -> None:
    """Write the JSON (variants measured in an earlier run and not re-run are kept, and the commands that measured
    them; `drive`: the drive's rate, kept from the earlier run when not measured again) and the PNG."""
    from benchmarks.common import commit

    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.bench_serve " + shlex.join(sys.argv[1:])
    commands = [command]
    if (out / "bench_serve.json").exists():
        before = json.loads((out / "bench_serve.json").read_text())
        results = {**before["results"], **results}
        commands = [c for c in before.get("commands", []) if c != command] + commands
        drive = drive or before.get("drive_4k_random_reads")
    ratios = decode_ratios(results)
    doc = {"commands": commands, "commit": commit(),
           "machine": versions(), "model": model, "engine": engine_config(model["num_hidden_layers"]), "decode": [DECODE_PROMPT, DECODE_TOKENS],
           "graph_mode": graph_mode, "results": results, "decode_ratios": ratios, "decode_ratio_rounds": ratio_rounds(ratios),
           **({"drive_4k_random_reads": drive} if drive else {})}  # fmt: skip
    (out / "bench_serve.json").write_text(json.dumps(doc, indent=2))
    try:
        plot(results, out / "bench_serve.png", describe(model, graph_mode))
    except ImportError:
        print("matplotlib missing: draw the PNG later with --plot-only", flush=True)


# 48 layers of GDN state per sequence: 8 GiB holds about a quarter of b = 256's sequences, which then decode in
# waves (4.15x b = 32's kernels per step in a profile)
RELEASE_KV_CACHE_BYTES = 48 << 30


def engine_config(layers: int) -> dict:
    return {**ENGINE, **({"kv_cache_memory_bytes": RELEASE_KV_CACHE_BYTES} if layers > MODEL["num_hidden_layers"] else {})}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--workdir", default="/tmp/bench_serve")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--timeout", type=int, default=560, help="seconds per variant (a 48-layer first start compiles for minutes)")
    parser.add_argument("--plot-only", action="store_true", help="draw the PNG from an existing JSON")
    parser.add_argument("--profile", action="store_true", help="also profile one decode run per batch")
    parser.add_argument("--batches", nargs="+", type=int, default=list(DECODE_BATCHES), help="decode batch sizes")
    parser.add_argument("--geometry", choices=["synthetic", "release"], default="synthetic")
    parser.add_argument("--table-gb", type=float, default=13.0, help="with --geometry release: INT8 table GB")
    parser.add_argument("--graph-mode", choices=GRAPH_MODES, default="breakable")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"],
                        help="decoder layers (the release has 48; one PLE layer, the third, either way)")
    parser.add_argument("--indexer-budget", type=int, help="QSA budget (default 32768: above max_model_len, where "
                        "our class runs exact dense attention; the release's 2048: both classes run QSA)")
    parser.add_argument("--memory-only", action="store_true", help="start each engine, report its bytes, stop")
    parser.add_argument("--cold", action="store_true", help="drop the checkpoint's pages from the page cache before "
                        "each engine starts (posix_fadvise): start-up and the file tier's first reads from disk; "
                        "reported as VARIANT@cold")
    parser.add_argument("--cold-reads", action="store_true", help="the checkpoint's pages forgotten before every timed "
                        "run and the file tier's read-around off: its misses (and vLLM's disk_offload) read the drive (decode_reads: the runs' drive bytes); "
                        "reported as VARIANT@cold-reads")
    parser.add_argument("--prompts", nargs="+", choices=PROMPT_KINDS, default=["uniform"],
                        help="prompt tokens: uniform ids, or natural English text (its n-grams repeat as text's do); "
                        "text_followed: text whose decode writes the text that follows it (benchmarks/follow_text.py); "
                        "several: each in turn in one engine, reported as VARIANT@SOURCE")
    parser.add_argument("--rounds", type=int, default=1, help="start the variants' engines this many times, in turn "
                        "(A B A B): rounds after the first are reported as VARIANT#ROUND, and each ratio's spread over the "
                        "rounds as decode_ratio_rounds")
    parser.add_argument("--first-round", type=int, default=1, help="the first round's number: a later call's rounds "
                        "added to the same --out (reported as VARIANT#ROUND from round 2)")
    parser.add_argument("--down-silu", help="host_int8_down_launch's launch: a sweep label, e.g. rows_n1_w4")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.worker and "host_int8_down_launch" in args.variants and not args.down_silu:
        parser.error("host_int8_down_launch serves the launch --down-silu names")
    return args


def worker_command(name: str, checkpoint: Path, result: Path, args: argparse.Namespace) -> list[str]:
    """This script as the variant's worker process, with the command line's settings that the worker reads."""
    cmd = [sys.executable, "-m", "benchmarks.bench_serve", "--worker", name, "--checkpoint", str(checkpoint), "--result", str(result)]
    cmd += ["--geometry", args.geometry, "--table-gb", str(args.table_gb), "--layers", str(args.layers)]
    cmd += ["--graph-mode", args.graph_mode, "--batches", *map(str, args.batches)] + (["--profile"] if args.profile else [])
    cmd += (["--memory-only"] if args.memory_only else []) + (["--cold-reads"] if args.cold_reads else []) + ["--prompts", *args.prompts]
    return cmd + (["--down-silu", args.down_silu] if args.down_silu else [])


def run_variant(name: str, checkpoint: Path, workdir: Path, args: argparse.Namespace) -> dict:
    """One variant's worker process (its log kept in `workdir`): what it measured by prompt source, or its error."""
    result = workdir / f"{name}.json"
    if args.cold:
        from benchmarks.common import drop_page_cache

        for f in Path(checkpoint).glob("*.safetensors"):
            drop_page_cache(f)
    try:
        proc = subprocess.run(worker_command(name, checkpoint, result, args), capture_output=True, text=True,
                              timeout=args.timeout, cwd=Path(__file__).resolve().parents[1])
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        log = f"timed out after {args.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    (workdir / f"{name}.log").write_text(log if isinstance(log, str) else log.decode())
    measured = json.loads(result.read_text()) if result.exists() else {}
    result.unlink(missing_ok=True)  # a later run of the variant must not report this one's figures
    if not measured:
        lines = [l for l in str(log).splitlines() if "Error" in l or "error" in l]
        measured = {"any": {"error": (lines[-1] if lines else str(log)[-500:]).strip()}}
    return measured


def main() -> None:
    args = parse_args()
    model = release_model(args.table_gb) if args.geometry == "release" else MODEL
    model = {**model, **depth(args.layers), **({"indexer_budget": args.indexer_budget} if args.indexer_budget else {})}
    if args.worker:
        return worker(args.worker, args.checkpoint, args.result, args, model["vocab_size"])
    if args.plot_only:
        doc = json.loads((Path(args.out) / "bench_serve.json").read_text())
        return plot(doc["results"], Path(args.out) / "bench_serve.png", describe(doc["model"], doc["graph_mode"]))
    geometry = f"release-{args.table_gb:g}gb" if args.geometry == "release" else "synthetic"
    budget = f"-budget{args.indexer_budget}" if args.indexer_budget else ""
    workdir = Path(args.workdir) / f"{geometry}-{model['num_hidden_layers']}layers{budget}"  # checkpoints are kept per model
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    checkpoints = write_checkpoints(workdir, model, {VARIANTS[name][2] for name in args.variants})
    print(f"checkpoints written in {time.monotonic() - t0:.0f} s", flush=True)
    drive = drive_rate(list(checkpoints.values())) if args.cold_reads and not args.worker else None
    if drive:
        print("the drive, 4 KiB random reads:", {d: round(r["iops"]) for d, r in drive.items()}, flush=True)
    results = {}
    for round_, name in itertools.product(range(args.first_round, args.first_round + args.rounds), args.variants):
        for kind, r in run_variant(name, checkpoints[VARIANTS[name][2]], workdir, args).items():
            key = (name if len(args.prompts) == 1 or kind == "any" else f"{name}@{kind}") + ("@cold" if args.cold else "")
            key += "@cold-reads" if args.cold_reads else ""
            key += f"#{round_}" if round_ > 1 else ""
            results[key] = {**r, "down_silu_launch": args.down_silu} if name == "host_int8_down_launch" else r
            print(key, json.dumps(r), flush=True)
        write_results(results, Path(args.out), model, args.graph_mode, drive)  # after every variant: a cut-off run keeps what it measured


if __name__ == "__main__":
    main()
