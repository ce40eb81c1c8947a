"""transformers' greedy continuations, the oracle of every vLLM parity test (`qwen4_exp_hcu.tiny.reference_greedy`
and its image/video forms), cached for the session: handed vLLM's answer as the candidate, each costs one
teacher-forced forward when that answer is right, and the result does not depend on it (`test_tiny.py`).
The checkpoints must not change on disk."""

from pathlib import Path

from qwen4_exp_hcu.tiny import reference_greedy, reference_greedy_image, reference_greedy_video

_RESULTS: dict[tuple, dict] = {}


def _cached(key: tuple, compute) -> dict:
    if key not in _RESULTS:
        _RESULTS[key] = compute()
    return _RESULTS[key]


def greedy(path: Path, prompts: list[list[int]], new_tokens: int, candidates=None) -> list[dict]:
    """Per prompt, transformers' greedy `tokens` and their `logprobs`; `candidates`: vLLM's token ids per prompt."""
    candidates = candidates or [None] * len(prompts)
    return [
        _cached((str(path), tuple(p), new_tokens), lambda p=p, c=c: reference_greedy(path, [list(p)], new_tokens, [c])[0])
        for p, c in zip(prompts, candidates, strict=True)
    ]


def greedy_image(path: Path, prompt: list[int], image, new_tokens: int, key: str, candidate=None) -> dict:
    """`reference_greedy_image` (also returns the expanded `prompt`); `key` names the image for the cache."""
    return _cached((str(path), tuple(prompt), new_tokens, key),
                   lambda: reference_greedy_image(path, prompt, image, new_tokens, candidate))  # fmt: skip


def greedy_video(path: Path, prompt: list[int], frames, new_tokens: int, key: str, candidate=None) -> dict:
    """`reference_greedy_video`; `key` names the video for the cache."""
    return _cached((str(path), tuple(prompt), new_tokens, key),
                   lambda: reference_greedy_video(path, prompt, frames, new_tokens, candidate))  # fmt: skip
