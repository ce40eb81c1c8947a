"""The engine every tiny-checkpoint vLLM test serves with, and greedy generation with top-5 logprobs from it.

`max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS` makes the longer prompts prefill in chunks, interleaved with other
requests' decode steps when batched; `max_model_len` is the tiny config's indexer budget, the most dense attention
may serve.
"""

import os

from helpers import engines
from helpers.scenarios import MAX_NEW_TOKENS, MAX_NUM_BATCHED_TOKENS


# The engine arguments every tiny-checkpoint test shares (its GPU memory share is each caller's).
SETTINGS = dict(
    dtype="bfloat16", max_model_len=512, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=4, seed=0
)


def start_engine(path, env=None, **kwargs):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function to an engine process
    return engines.start(path, env, **SETTINGS, gpu_memory_utilization=0.5, **kwargs)


stop_engine = engines.stop


def generate(llm, prompts, max_tokens=MAX_NEW_TOKENS, full=False):
    """Greedy continuations of token-id `prompts`, top-5 logprobs each step (the `RequestOutput`s when `full`)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outputs if full else [o.outputs[0] for o in outputs]


def tokens(outputs) -> list[list[int]]:
    return [list(out.token_ids) for out in outputs]
