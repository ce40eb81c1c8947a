"""transformers' greedy continuations, the oracle of every vLLM parity test, found by teacher forcing.

`qwen4_exp_hcu.tiny.reference_greedy` re-runs the whole sequence once per new token (32 forwards per
prompt). A causal model gives every step's logits in one forward over the prompt and a candidate
continuation, so the greedy continuation is the fixed point of "force the candidate, take each step's
argmax": where the candidate first differs from the argmax, that step is corrected and the rest forced
again (each round fixes at least one more step). Handed vLLM's answer, a right one costs one forward;
without a candidate, or with a wrong one, it costs up to one forward per step, as before. The result does
not depend on the candidate: the same tokens and `[new tokens, vocab]` fp32 log-probabilities as
`reference_greedy` (`test_tiny.py` checks both agree). Results and the fp32 models are cached per checkpoint
for the session; the checkpoints must not change on disk.
"""

import functools
from pathlib import Path

import torch

_RESULTS: dict[tuple, dict] = {}


@functools.lru_cache(maxsize=2)
def _model(path: str):
    """transformers' class for the checkpoint's architecture (multimodal ones too), fp32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = hasattr(AutoConfig.from_pretrained(path), "vision_config")
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _greedy(model, prompt: list[int], new_tokens: int, candidate, mm_token=None, mm_type=1, **inputs) -> dict:
    """The greedy continuation of `prompt`, never stopping at EOS (vLLM's `ignore_eos`), from `candidate`
    (see the module docstring). `mm_token` marks multimodal placeholders (`mm_token_type_ids` = `mm_type`
    there: 1 image, 2 video)."""
    tokens = [int(t) for t in (candidate or [])][:new_tokens]
    while True:
        ids = torch.tensor([prompt + tokens])
        if mm_token is not None:
            inputs["mm_token_type_ids"] = (ids == mm_token).int() * mm_type
        logits = model(input_ids=ids, use_cache=False, **inputs).logits[0, len(prompt) - 1 :]
        rows = logits.log_softmax(-1)
        best = rows.argmax(-1).tolist()  # best[i]: the greedy token after tokens[:i]
        wrong = next((i for i, t in enumerate(tokens) if t != best[i]), len(tokens))
        if wrong == len(tokens) == new_tokens:
            return {"tokens": tokens, "logprobs": rows[:new_tokens]}
        tokens = tokens[:wrong] + best[wrong : wrong + 1] + tokens[wrong + 1 :]  # the rest forced again


def _cached(key: tuple, compute) -> dict:
    if key not in _RESULTS:
        _RESULTS[key] = compute()
    return _RESULTS[key]


def greedy(path: Path, prompts: list[list[int]], new_tokens: int, candidates=None) -> list[dict]:
    """Per prompt, transformers' greedy `tokens` and their `logprobs` (`reference_greedy`'s result);
    `candidates`: vLLM's token ids per prompt, the continuation forced first."""
    candidates = candidates or [None] * len(prompts)
    return [
        _cached((str(path), tuple(p), new_tokens), lambda p=p, c=c: _greedy(_model(str(path)), list(p), new_tokens, c))
        for p, c in zip(prompts, candidates, strict=True)
    ]


def greedy_image(path: Path, prompt: list[int], image, new_tokens: int, key: str, candidate=None) -> dict:
    """`greedy` for a prompt with one `<|image_pad|>` that the image processor's grid expands, as vLLM's
    processor does (`reference_greedy_image`); `key` names the image for the cache. Also returns the
    expanded `prompt`."""
    from transformers import AutoImageProcessor

    def compute():
        model = _model(str(path))
        pixels = AutoImageProcessor.from_pretrained(path)(images=[image], return_tensors="pt")
        pad = model.config.image_token_id
        n_image = int(pixels["image_grid_thw"].prod()) // model.config.vision_config.spatial_merge_size**2
        i = prompt.index(pad)
        expanded = prompt[:i] + [pad] * n_image + prompt[i + 1 :]
        result = _greedy(
            model, expanded, new_tokens, candidate, mm_token=pad,
            pixel_values=pixels["pixel_values"].float(), image_grid_thw=pixels["image_grid_thw"],
        )  # fmt: skip
        return {**result, "prompt": expanded}

    return _cached((str(path), tuple(prompt), new_tokens, key), compute)


def greedy_video(path: Path, prompt: list[int], frames, new_tokens: int, key: str, candidate=None) -> dict:
    """`greedy` for a video prompt as vLLM's processor expanded it; transformers gets the same frames through
    the checkpoint's video processor, no frame sampling (`reference_greedy_video`)."""
    from transformers import AutoVideoProcessor

    def compute():
        model = _model(str(path))
        pixels = AutoVideoProcessor.from_pretrained(path)(videos=[frames], do_sample_frames=False, return_tensors="pt")
        return _greedy(
            model, prompt, new_tokens, candidate, mm_token=model.config.video_token_id, mm_type=2,
            pixel_values_videos=pixels["pixel_values_videos"].float(), video_grid_thw=pixels["video_grid_thw"],
        )  # fmt: skip

    return _cached((str(path), tuple(prompt), new_tokens, key), compute)
