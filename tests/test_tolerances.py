"""The parity bounds of `helpers.scenarios` against the noise they must admit: transformers' own bf16 run of the
tiny INT8 checkpoint, measured against its fp32 run the way the engine tests measure vLLM (top-5 logprobs)."""

import pytest
import torch

from helpers.checkpoints import sharpen_attention
from helpers.scenarios import LONG, LONG_FAULT_RATIO, PREFIX, PREFIX_PROMPT, PROMPTS, TINY, logprob_errors
from qwen4_exp_hcu.tiny import dequantized_checkpoint, make_tiny_checkpoint, make_tiny_int8_checkpoint, reference_greedy


@pytest.fixture(scope="module")
def dequantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("tolerances")
    return dequantized_checkpoint(make_tiny_int8_checkpoint(root / "int8"), root / "dequantized")


def bf16_noise(path, prompts, max_new_tokens) -> torch.Tensor:
    exact = reference_greedy(path, prompts, max_new_tokens)
    bf16 = reference_greedy(path, prompts, max_new_tokens, [r["tokens"] for r in exact], dtype=torch.bfloat16)
    errors = []
    for b, e in zip(bf16, exact, strict=True):
        assert b["tokens"] == e["tokens"]
        top = b["logprobs"].float().topk(5, -1).indices  # bf16's top-5 per step, as vLLM's are compared
        pairs = [[(int(t), b["logprobs"][step, t].item()) for t in top[step]] for step in range(len(top))]
        errors.append(logprob_errors(pairs, e["logprobs"]))
    return torch.cat(errors)


def test_short_prompts_bf16_noise_is_within_tiny(dequantized):
    errors = bf16_noise(dequantized, PROMPTS, 32)
    print(f"short prompts, transformers bf16 vs fp32: mean {errors.mean():.4f} max {errors.max():.4f}")
    assert TINY.holds(errors)


def test_prefix_prompt_bf16_noise_needs_its_own_bound(dequantized):
    """400 tokens: bf16 rounding alone leaves `TINY` (measured 0.019 / 0.154), so the prefix prompt against
    transformers is held to `PREFIX` and its cache hit to the miss (`REPEAT`)."""
    errors = bf16_noise(dequantized, [PREFIX_PROMPT], 8)
    print(f"prefix prompt, transformers bf16 vs fp32: mean {errors.mean():.4f} max {errors.max():.4f}")
    assert not TINY.holds(errors) and PREFIX.holds(errors)


def _teacher_forced(path, ids: list[int], steps: int, dtype=torch.float32, **config) -> torch.Tensor:
    """transformers' log-probabilities of the last `steps` positions of `ids` (each predicting the next)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **config).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -steps - 1 : -1].float().log_softmax(-1)


def _top5_errors(run: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    top = run.topk(5, -1).indices
    return (run.gather(-1, top) - reference.gather(-1, top)).abs().flatten()


def test_sharpened_attention_tells_qsa_from_dense(tmp_path):
    """The long-context oracle has teeth: beyond the budget, dense attention (the fault) moves transformers' logprobs
    by `LONG_FAULT_RATIO` x its own bf16 noise and out of `LONG`, which holds that noise, at 3000 tokens."""
    budget, steps = 2048, 16
    path = sharpen_attention(make_tiny_checkpoint(tmp_path / "bf16", indexer_budget=budget, max_position_embeddings=4096))
    ids = torch.randint(3, 512, (3000 + steps,), generator=torch.Generator().manual_seed(3)).tolist()
    qsa = _teacher_forced(path, ids, steps, indexer_budget=budget)
    noise = _top5_errors(_teacher_forced(path, ids, steps, torch.bfloat16, indexer_budget=budget), qsa)
    dense = _top5_errors(_teacher_forced(path, ids, steps, indexer_budget=len(ids)), qsa)
    print(f"3000 tokens, sharpened: bf16 noise {noise.mean():.4f} / {noise.max():.4f}, "
          f"dense {dense.mean():.4f} / {dense.max():.4f}")
    assert LONG.holds(noise) and not LONG.holds(dense)
    assert dense.mean() >= LONG_FAULT_RATIO * noise.mean()
