"""`benchmarks/peer_logprobs.py`'s side of the comparison that needs no engine: how two classes' top-5 logprobs are
compared, per prompt, and the long-context batch and checkpoint it serves both classes."""

import json

import pytest
import torch

from benchmarks import peer_logprobs


def run(tokens, steps):
    return {"tokens": tokens, "logprobs": steps}


def test_entries_both_top5s_hold_are_compared_per_prompt():
    ours = [run([1, 2], [{"1": -0.10, "7": -2.0}, {"2": -0.30}]), run([4], [{"4": -1.0, "5": -1.5}])]
    upstream = [run([1, 2], [{"1": -0.12, "8": -2.0}, {"2": -0.25}]), run([5], [{"4": -1.2, "5": -1.4}])]
    got = peer_logprobs.compare(ours, upstream, [3000, 5])
    assert got["same_greedy_tokens"] == 1 and got["compared"] == 4  # "7" and "8" each in one top-5 only
    assert got["per_prompt"]["3000"]["compared"] == 2
    assert got["per_prompt"]["3000"]["max_abs"] == pytest.approx(0.05)
    assert got["per_prompt"]["5"]["mean_abs"] == pytest.approx(0.15)
    assert got["max_abs"] == pytest.approx(0.2) and got["mean_abs"] == pytest.approx((0.02 + 0.05 + 0.2 + 0.1) / 4)


def test_one_prompt_off_shows_in_its_own_figures_only():
    """A fault in the long prompt's steps (0.5 off) moves that prompt's figures, not the short one's."""
    steps = [{"1": -0.1, "2": -1.0}] * 16
    clean = [run([1] * 16, steps), run([1] * 16, steps)]
    broken = [run([1] * 16, [{t: v - 0.5 for t, v in s.items()} for s in steps]), run([1] * 16, steps)]
    got = peer_logprobs.compare(broken, clean, [8000, 40])
    assert got["per_prompt"]["8000"]["mean_abs"] == pytest.approx(0.5) and got["per_prompt"]["40"]["max_abs"] == 0


def test_top5s_that_share_no_token_give_no_figure():
    got = peer_logprobs.compare([run([1], [{"1": -0.1}])], [run([2], [{"2": -0.1}])], [5])
    assert got["compared"] == 0 and got["mean_abs"] is None and got["max_abs"] is None


def test_the_long_batch_is_the_long_context_tests():
    import test_vllm_long_context as long_test

    batch = peer_logprobs.prompts(long=True)
    assert [len(p) for p in batch] == list(long_test.LENGTHS)
    assert peer_logprobs.LONG_MAX_MODEL_LEN == long_test.MAX_MODEL_LEN and peer_logprobs.LONG_BUDGET == long_test.BUDGET
    assert sum(len(p) > long_test.BUDGET for p in batch) == 3
    assert peer_logprobs.prompts(long=False) == peer_logprobs.PROMPTS


def test_the_long_checkpoint_has_the_budget_and_sharpened_attention(tmp_path):
    from safetensors.torch import load_file

    from qwen4_exp_hcu.tiny import make_tiny_checkpoint

    sharp = peer_logprobs.make_long_checkpoint(str(tmp_path / "long"))
    plain = make_tiny_checkpoint(tmp_path / "plain", indexer_budget=2048, max_position_embeddings=8256)
    config = json.loads((sharp / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["indexer_budget"] == 2048 and text["max_position_embeddings"] == 8256
    a, b = load_file(next(sharp.glob("*.safetensors"))), load_file(next(plain.glob("*.safetensors")))
    sharpened = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "indexer.q_layernorm.weight", "indexer.k_layernorm.weight")
    norms = [k for k in a if k.endswith(sharpened)]
    assert len(norms) >= 4 and all(not torch.equal(a[k], b[k]) for k in norms)
    assert all(torch.equal(a[k], b[k]) for k in a if k not in norms)  # nothing else touched
