"""Long context on a GPU: prompts of 3k-8k tokens, beyond the QSA indexer budget, against transformers.

Beyond `indexer_budget` (2048 in the release) attention is QSA: each query attends to the top-scoring key
blocks only. Our class then runs vLLM's own QSA attention (`model.vllm_api.qsa_attention_builder`); every
other engine test keeps `max_model_len` within the budget, where dense attention is exact. Here a tiny INT8
checkpoint with the release's budget (2048, blocks of 4), its attention and indexer sharpened
(`helpers.checkpoints.sharpen_attention`: random weights alone attend almost uniformly, so which blocks QSA keeps
would hardly matter), serves three long prompts and two short ones in one batch with 1024-token steps, so the long
prefills run in chunks beside the short ones' decode steps; every step's top-5 logprobs are compared with
transformers (fp32, its own QSA indexer) within `helpers.scenarios.LONG`. The same engine with dense attention
patched in beyond the budget (the fault QSA guards against) must fail it at every long prompt, by
`LONG_FAULT_RATIO` x the QSA run's mean error.

    source .gpu-vllm/setup.sh && source tools/gpu_cute_dsl.sh install && python3 -m pytest -s tests/test_vllm_long_context.py
(vLLM's QSA kernels need the CuTe DSL and FlashAttention 3: `tools/gpu_cute_dsl.sh` brings both to the GPU machine.)
"""

import os

import pytest
import torch

from helpers import engines, faults
from helpers.checkpoints import sharpen_attention
from helpers.scenarios import GPU_ENGINE, LONG, LONG_FAULT_RATIO, logprob_errors
from qwen4_exp_hcu.tiny import dequantized_checkpoint, make_tiny_int8_checkpoint, reference_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

BUDGET = 2048  # the release's indexer_budget
LENGTHS = (3000, 5000, 8000, 5, 40)  # three beyond the budget, two short ones decoding beside their prefills
MAX_NEW_TOKENS = 16
MAX_MODEL_LEN = 8192 + 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("QSA attention runs on CUDA-alike accelerators only")
    return sharpen_attention(make_tiny_int8_checkpoint(
        tmp_path_factory.mktemp("long") / "int8", indexer_budget=BUDGET, max_position_embeddings=MAX_MODEL_LEN
    ))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in LENGTHS]


def serve(checkpoint, prompts, fault=None) -> list[dict]:
    """One concurrent batch through a fresh engine, with `fault` (`helpers.faults`) injected where it runs."""
    from vllm import SamplingParams

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function to the engine

    def start(env):
        return engines.start(checkpoint, env=env, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, seed=0,
                             max_num_batched_tokens=1024, max_num_seqs=len(prompts), **GPU_ENGINE)  # fmt: skip

    def run(llm):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        attention = llm.apply_model(lambda model: type(model.model.layers[1].self_attn).__name__)[0]
        return [{"tokens": list(o.outputs[0].token_ids), "attention": attention,
                 "logprobs": [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
                for o in outs]  # fmt: skip

    if fault is not None:
        with engines.fresh_with_fault(fault, start) as llm:
            return run(llm)
    llm = start({})
    try:
        return run(llm)
    finally:
        engines.stop(llm)


@pytest.fixture(scope="module")
def served(checkpoint, prompts):
    return serve(checkpoint, prompts)


@pytest.fixture(scope="module")
def reference(checkpoint, prompts, served, tmp_path_factory):
    dequantized = dequantized_checkpoint(checkpoint, tmp_path_factory.mktemp("long") / "dequantized")
    return reference_greedy(dequantized, prompts, MAX_NEW_TOKENS, [s["tokens"] for s in served])


def errors_per_prompt(served, reference) -> list[tuple[int, float, float, bool]]:
    rows = []
    for out, ref, n in zip(served, reference, LENGTHS, strict=True):
        err = logprob_errors(out["logprobs"], ref["logprobs"])
        rows.append((n, err.mean().item(), err.max().item(), out["tokens"] == ref["tokens"]))
        print(f"LONG-CONTEXT {n:>5} tokens ({out['attention']}): top-5 logprob err mean {rows[-1][1]:.4f} "
              f"max {rows[-1][2]:.4f} tokens_equal={rows[-1][3]}")  # fmt: skip
    return rows


def test_qsa_beyond_the_budget_matches_transformers(served, reference, record_property):
    assert {s["attention"] for s in served} == {"Qwen4ExpQSAAttention"}
    for n, mean, worst, tokens_equal in errors_per_prompt(served, reference):
        record_property(f"mean / max at {n} tokens", f"{mean:.4f} / {worst:.4f}")
        assert tokens_equal and mean < LONG.mean and worst < LONG.max, (n, mean, worst)


def test_dense_attention_beyond_the_budget_is_caught(checkpoint, prompts, served, reference, record_property):
    """The fault QSA guards against: dense attention over every token of the long prompts."""
    dense = serve(checkpoint, prompts, faults.dense_attention_beyond_the_budget)
    assert {s["attention"] for s in dense} == {"DenseGatedAttention"}
    rows = errors_per_prompt(dense, reference)
    correct = {n: mean for n, mean, *_ in errors_per_prompt(served, reference)}
    for n, mean, worst, _ in rows:
        record_property(f"mean / max at {n} tokens", f"{mean:.4f} / {worst:.4f}")
        if n > BUDGET:
            assert mean >= LONG.mean or worst >= LONG.max, (n, mean, worst)
            assert mean >= LONG_FAULT_RATIO * correct[n], (n, mean, correct[n])
