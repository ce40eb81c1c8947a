"""Tiny random Qwen4Exp checkpoints for tests and the demo.

`python -m qwen4_exp_hcu.tiny DST [--int8] [--vision] [--config CONFIG.json] [--weight-seed 0]` writes a
text-only `Qwen4ExpForCausalLM` (with `--vision`: a `Qwen4ExpForConditionalGeneration`, as the official
checkpoints are) with transformers' own `save_pretrained` (so the layout is exactly what transformers
writes: sharded PLE tables, per-expert MoE weights) plus an offline word-level tokenizer. Weights are drawn
with a fixed seed at a scale where greedy decoding is not degenerate (distinct prompts → distinct tokens);
the PLE conv is made non-zero (transformers initialises it to zero) so its state is exercised.
`--int8` also runs the quantizer (`qwen4_exp_hcu.quantize`): BF16 at `DST-bf16`, INT8 PLE tables at DST.

`reference_greedy` and `dequantized_checkpoint` give the transformers oracle the vLLM tests compare with.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

DEFAULT_CONFIG = Path(__file__).resolve().with_name("tiny_config.json")  # package data
# Multimodal checkpoints: a two-block vision tower (16-px patches, 2x2 merge: a 64x64 image is 4 tokens) and
# the vision special tokens at the top of the tiny vocab.
TINY_VISION = dict(
    depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, spatial_merge_size=2,
    temporal_patch_size=2, num_position_embeddings=64, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)  # fmt: skip
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}  # fmt: skip
IMAGE_PIXELS = (32 * 32, 128 * 128)  # the image processor's min/max pixels: at most 16 tokens per image
# Share of each lm_head row that points at the embedding of the token it predicts next (see below).
SUCCESSOR_WEIGHT = 0.6


def load_config(config_path: str | Path = DEFAULT_CONFIG, **overrides):
    """`Qwen4ExpTextConfig` from a JSON file, with keyword overrides (e.g. `ple_layer_ids=[]`)."""
    from transformers import Qwen4ExpTextConfig

    values = json.loads(Path(config_path).read_text())
    values.update(overrides)
    values.pop("model_type", None)
    return Qwen4ExpTextConfig(**values)


def build_tokenizer(vocab_size: int, eos_token_id: int, bos_token_id: int, pad_token_id: int, extra: dict | None = None):
    """A word-level tokenizer: specials, then `t{i}` for every other id; made in code, no downloads.
    `extra` ({id: token}) adds special tokens matched anywhere in a text (the vision placeholders)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    extra = extra or {}
    specials = {pad_token_id: "<pad>", eos_token_id: "<eos>", bos_token_id: "<bos>", **extra}
    vocab = {specials.get(i, f"t{i}"): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        bos_token="<bos>",
        pad_token="<pad>",
        unk_token="<pad>",
        additional_special_tokens=list(extra.values()),
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, exclude: tuple[int, ...] = ()) -> None:
    """Re-draw every weight so activations stay O(1) through the tiny network.

    Matrices get std 1/sqrt(fan_in); embeddings (token and PLE n-gram) std 1; norm weights a small
    perturbation around their neutral value; GDN `A_log`/`dt_bias` and PLE hash buffers are kept.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            continue
        if "norm" in name:
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(param.float() + noise)
        elif param.ndim == 5:  # the vision patch embedding, a Conv3d
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param[0].numel()))
        elif "embed" in name:
            param.copy_(torch.randn(param.shape, generator=gen))
        elif name.endswith("conv1d.weight"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        else:
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
    _make_greedy_unambiguous_(model, gen, exclude)


@torch.no_grad()
def _make_greedy_unambiguous_(model: torch.nn.Module, gen: torch.Generator, exclude: tuple[int, ...] = ()) -> None:
    """Give greedy decoding a margin far above bf16 noise, keeping every logit context-dependent.

    A random lm_head gives near-uniform logits over 512 tokens: ~1.6% of greedy steps are decided by a
    gap smaller than the bf16 rounding differences between two correct implementations, so token
    parity between vLLM (bf16) and transformers would be luck. Each lm_head row is therefore a blend of
    a random direction (context-dependent logits) and the embedding of the token it follows in a fixed
    512-cycle, which makes that successor the argmax by a wide margin. Continuations stay distinct per
    prompt and never repeat a token within 512 steps; logprobs still depend on the whole network.
    Tokens in `exclude` (the vision placeholders) stay out of the cycle and are never the greedy choice.
    """
    embed = model.get_input_embeddings().weight.float()
    vocab = embed.shape[0]
    cycle = torch.tensor([t for t in range(vocab) if t not in set(exclude)])
    order = cycle[torch.randperm(len(cycle), generator=gen)]
    previous = torch.arange(vocab)
    previous[order] = order.roll(1)  # the token each token follows in the cycle
    successor_rows = embed[previous]
    lm_head = model.lm_head.weight
    unit = lambda w: w / w.norm(dim=1, keepdim=True)  # noqa: E731
    scale = math.sqrt(embed.shape[1]) / 4
    lm_head.copy_(scale * (SUCCESSOR_WEIGHT * unit(successor_rows) + (1 - SUCCESSOR_WEIGHT) * unit(lm_head.float())))
    lm_head[list(exclude)] = 0  # every step's successor scores far above 0


def make_tiny_checkpoint(
    dst: str | Path,
    config_path: str | Path = DEFAULT_CONFIG,
    weight_seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    **overrides,
) -> Path:
    """Write a random tiny checkpoint (config, safetensors, tokenizer) to `dst` and return it.
    `weight_seed` draws the weights; the config's own `seed` (an override) is the n-gram hash seed."""
    from transformers import Qwen4ExpForCausalLM

    config = load_config(config_path, **overrides)
    torch.manual_seed(weight_seed)
    model = Qwen4ExpForCausalLM(config)
    randomize_(model, weight_seed)
    model = model.to(dtype)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    tokenizer = build_tokenizer(config.vocab_size, config.eos_token_id, config.bos_token_id, config.pad_token_id)
    tokenizer.save_pretrained(dst)
    return dst


@torch.no_grad()
def add_mtp_head(path: str | Path, seed: int = 1, follow_target: bool = False) -> Path:
    """Give the checkpoint at `path` an MTP head as releases store it (`mtp.*`, one attention + MoE layer;
    `mtp_num_hidden_layers: 1`): its layer and mixer are the model's last attention layer and final mixer
    plus noise, its norms and fc projections random. Random drafts are almost always rejected.

    `follow_target`: a head whose drafts get accepted. A tiny random model's greedy token follows its last
    token (the embedding dominates the streams), so a head that ignores the target's streams (`fc_hidden`
    zero) and feeds the next token's embedding through unchanged (`fc_embedding` identity, the norm scaled
    back to the embeddings' RMS) drafts what the target will decode."""
    import json

    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    prefix = "model.language_model." if "text_config" in config else "model."
    last = max(i for i, t in enumerate(text["layer_types"]) if t != "linear_attention")
    gen = torch.Generator().manual_seed(seed)
    noisy = lambda t: (t.float() + 0.01 * torch.randn(t.shape, generator=gen)).to(t.dtype)  # noqa: E731
    weights = load_file(path / "model.safetensors")
    H, width = text["hidden_size"], text["hidden_size"] * text["hc_count"]
    head = {}
    for key, t in weights.items():
        for src, dst in ((f"{prefix}layers.{last}.", "mtp.layers.0."), (f"{prefix}hyper_connection_mixer.", "mtp.hyper_connection_mixer.")):
            if key.startswith(src) and ".ple." not in key:
                head[dst + key[len(src):]] = noisy(t)
    if follow_target:
        embed = weights[f"{prefix}embed_tokens.weight"].float()
        head["mtp.fc_embedding.weight"] = torch.eye(H, dtype=torch.bfloat16)
        head["mtp.fc_hidden.weight"] = torch.zeros(H, H, dtype=torch.bfloat16)
        head["mtp.pre_fc_norm_embedding.weight"] = embed.pow(2).mean(-1).sqrt().mean().expand(H).to(torch.bfloat16)
    else:
        head["mtp.fc_embedding.weight"] = (torch.randn(H, H, generator=gen) / H**0.5).to(torch.bfloat16)
        head["mtp.fc_hidden.weight"] = (torch.randn(H, H, generator=gen) / H**0.5).to(torch.bfloat16)
        head["mtp.pre_fc_norm_embedding.weight"] = (0.1 * torch.randn(H, generator=gen)).to(torch.bfloat16)
    head["mtp.pre_fc_norm_hidden.weight"] = (0.1 * torch.randn(width, generator=gen)).to(torch.bfloat16)
    save_file({**weights, **head}, path / "model.safetensors", metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_tiny_vl_checkpoint(
    dst: str | Path, config_path: str | Path = DEFAULT_CONFIG, weight_seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    **overrides,
) -> Path:
    """A `Qwen4ExpForConditionalGeneration` (the official checkpoints' architecture): the tiny text model
    plus `TINY_VISION`, written with the tokenizer and a Qwen3-VL processor's files (its image processor in
    `preprocessor_config.json`; the video processor, which needs torchvision, takes its defaults)."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = load_config(config_path, **overrides)
    token_ids = {key: text.vocab_size - len(VISION_TOKENS) + i for i, key in enumerate(VISION_TOKENS)}
    config = Qwen4ExpConfig(
        text_config=text.to_dict(),
        vision_config={**TINY_VISION, "out_hidden_size": text.hidden_size},
        architectures=["Qwen4ExpForConditionalGeneration"],
        **token_ids,
    )
    torch.manual_seed(weight_seed)
    model = Qwen4ExpForConditionalGeneration(config)
    randomize_(model, weight_seed, exclude=tuple(token_ids.values()))
    dst = Path(dst)
    model.to(dtype).save_pretrained(dst)
    extra = {token_ids[key]: token for key, token in VISION_TOKENS.items()}
    tokenizer = build_tokenizer(text.vocab_size, text.eos_token_id, text.bos_token_id, text.pad_token_id, extra)
    tokenizer.save_pretrained(dst)
    vision = config.vision_config
    images = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
        size={"shortest_edge": IMAGE_PIXELS[0], "longest_edge": IMAGE_PIXELS[1]},
    )
    images.save_pretrained(dst)
    (dst / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    return dst


def make_tiny_int8_checkpoint(
    dst: str | Path, config_path: str | Path = DEFAULT_CONFIG, weight_seed: int = 0, vision: bool = False, **overrides
) -> Path:
    """BF16 checkpoint at `DST-bf16` (multimodal with `vision`), then the quantizer's INT8-PLE copy at `dst`."""
    from qwen4_exp_hcu.quantize import quantize_checkpoint

    dst = Path(dst)
    make = make_tiny_vl_checkpoint if vision else make_tiny_checkpoint
    bf16 = make(dst.with_name(f"{dst.name}-bf16"), config_path, weight_seed, **overrides)
    quantize_checkpoint(bf16, dst)
    return dst


@torch.no_grad()
def write_random_tables(dst: str | Path, text_config, fmt: str = "int8", seed: int = 0) -> dict[str, str]:
    """Random PLE tables of `text_config`'s size (text-only names) in `fmt`, a `ple.formats.rows.FORMATS` name (values
    N(0, 1) before the format stores them), into DST: one safetensors file per table shard, the table's hash buffers
    and table scale beside its first shard. Each shard is drawn (on the accelerator where there is one) and written
    alone, so a table of many GB under a small model never sits in memory whole. Returns {tensor: file} for the
    checkpoint's index; the config's declaration of `fmt` is the caller's."""
    from safetensors.torch import save_file

    from qwen4_exp_hcu.names import HASH_BUFFERS, SCALE_SUFFIX, TABLE, ple_layers
    from qwen4_exp_hcu.ple.formats.rows import FORMATS
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec

    form, device = FORMATS[fmt], "cuda" if torch.cuda.is_available() else "cpu"
    gen, files = torch.Generator(device).manual_seed(seed), {}
    # N(0, 1) values: 6 standard deviations bound all but about one in 10^9 (those saturate)
    table_scale = form.quantize_table_scale(6.0) if form.quantize_table_scale else torch.ones(1)
    for layer in ple_layers(text_config):
        spec, table = NgramHashSpec.from_config(text_config, layer.ple), f"{layer.prefix}{TABLE}"
        first = {f"{layer.prefix}ple_embedding.{n}": t for n, t in zip(HASH_BUFFERS, spec.tensors("cpu"))}
        if form.table_scale:
            first[f"{table}.{form.table_scale}"] = table_scale.to(getattr(torch, form.table_scale_dtype))
        per = -(-spec.rows // text_config.split_ngram_parts)
        for j in range(text_config.split_ngram_parts):
            rows = torch.randn(max(0, min(per, spec.rows - j * per)), spec.head_dim, generator=gen, device=device)
            weight, scale = form.quantize(rows, table_scale) if form.quantize else (rows.to(getattr(torch, form.weight)), None)
            shard = {f"{table}.shard_{j}.weight": weight.cpu(), **({} if j else first)}
            if scale is not None:
                shard[f"{table}.shard_{j}.{SCALE_SUFFIX}"] = scale.cpu()
            file = f"ple-{layer.decoder}-{j:04d}.safetensors"
            save_file(shard, Path(dst) / file, metadata={"format": "pt"})
            files.update(dict.fromkeys(shard, file))
    return files


def dequantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Copy of an INT8-PLE checkpoint with every table shard dequantized to BF16 (`int8 * scale`, the
    row format's reference) and no quantization config: what transformers runs as the INT8 oracle."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from qwen4_exp_hcu.names import SCALE_SUFFIX
    from qwen4_exp_hcu.ple.formats.int8 import dequantize_rows

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            with safe_open(f, "pt") as st:
                tensors = {k: st.get_tensor(k) for k in st.keys()}
            for name in [k for k in tensors if k.endswith(f".{SCALE_SUFFIX}")]:
                weight = name.removesuffix(SCALE_SUFFIX) + "weight"
                tensors[weight] = dequantize_rows(tensors[weight], tensors.pop(name))
            save_file(tensors, dst / f.name, metadata={"format": "pt"})
        elif f.name == "config.json":
            config = json.loads(f.read_text())
            config.pop("quantization_config")
            (dst / f.name).write_text(json.dumps(config, indent=2))
        elif f.is_file():
            shutil.copy2(f, dst / f.name)
    return dst


def _reference_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' class for the checkpoint's architecture (multimodal ones too), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    multimodal = hasattr(AutoConfig.from_pretrained(path), "vision_config")
    auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype).eval()


def _greedy(model, prompt: list[int], max_new_tokens: int, candidate=None, mm_token: int | None = None, mm_type: int = 1,
            **inputs) -> dict:  # fmt: skip
    """Greedy decoding without a cache, never stopping at EOS (like vLLM's `ignore_eos`): the new tokens and
    their `[max_new_tokens, vocab]` log-probabilities. A causal model gives every step's logits in one forward
    over the prompt and a candidate continuation, so the greedy continuation is the fixed point of "force the
    candidate, take each step's argmax": where the candidate first differs, that step is corrected and the rest
    forced again. Handed the right answer (e.g. vLLM's), one forward; with a wrong one or none, at most one
    per step. The result does not depend on the candidate. `mm_token` marks multimodal placeholders
    (`mm_token_type_ids` = `mm_type` there: 1 image, 2 video)."""
    tokens = [int(t) for t in (candidate or [])][:max_new_tokens]
    while True:
        ids = torch.tensor([list(prompt) + tokens])
        if mm_token is not None:
            inputs["mm_token_type_ids"] = (ids == mm_token).int() * mm_type
        rows = model(input_ids=ids, use_cache=False, **inputs).logits[0, len(prompt) - 1 :].log_softmax(-1)
        best = rows.argmax(-1).tolist()  # best[i]: the greedy token after tokens[:i]
        wrong = next((i for i, t in enumerate(tokens) if t != best[i]), len(tokens))
        if wrong == len(tokens) == max_new_tokens:
            return {"tokens": tokens, "logprobs": rows[:max_new_tokens]}
        tokens = tokens[:wrong] + best[wrong : wrong + 1] + tokens[wrong + 1 :]


@torch.no_grad()
def reference_greedy(
    path: str | Path, prompts: list[list[int]], max_new_tokens: int, candidates=None, dtype: torch.dtype = torch.float32
) -> list[dict]:
    """transformers' greedy continuation of each prompt, with fp32 weights (the most exact oracle; bf16 measures
    the noise a bf16 engine cannot avoid): per prompt the tokens and the `[max_new_tokens, vocab]`
    log-probabilities. `candidates`: a guess per prompt (vLLM's tokens) that makes it one forward when right."""
    model = _reference_model(path, dtype)
    return [_greedy(model, p, max_new_tokens, c) for p, c in zip(prompts, candidates or [None] * len(prompts), strict=True)]


@torch.no_grad()
def reference_greedy_image(path: str | Path, prompt: list[int], image, max_new_tokens: int, candidate=None) -> dict:
    """`reference_greedy` for a multimodal checkpoint: `prompt` holds one `<|image_pad|>` that the
    processor's image grid expands, as vLLM's processor does; transformers gets the same pixel values,
    grid and `mm_token_type_ids` (its M-RoPE positions). Returns the tokens, log-probabilities and the
    expanded prompt."""
    from transformers import AutoImageProcessor

    model = _reference_model(path)
    pixels = AutoImageProcessor.from_pretrained(path)(images=[image], return_tensors="pt")
    pad = model.config.image_token_id
    n_image = int(pixels["image_grid_thw"].prod()) // model.config.vision_config.spatial_merge_size**2
    i = prompt.index(pad)
    expanded = prompt[:i] + [pad] * n_image + prompt[i + 1 :]
    result = _greedy(
        model, expanded, max_new_tokens, candidate, mm_token=pad,
        pixel_values=pixels["pixel_values"].float(), image_grid_thw=pixels["image_grid_thw"],
    )  # fmt: skip
    return {**result, "prompt": expanded}


@torch.no_grad()
def reference_greedy_video(path: str | Path, prompt: list[int], frames, max_new_tokens: int, candidate=None) -> dict:
    """`reference_greedy` for a video: `prompt` as vLLM's processor expanded it (each frame group wrapped
    in vision start/end, its placeholders repeated); transformers gets the same frames through the
    checkpoint's video processor (no frame sampling) and `mm_token_type_ids` 2 on the placeholders."""
    from transformers import AutoVideoProcessor

    model = _reference_model(path)
    pixels = AutoVideoProcessor.from_pretrained(path)(videos=[frames], do_sample_frames=False, return_tensors="pt")
    return _greedy(
        model, prompt, max_new_tokens, candidate, mm_token=model.config.video_token_id, mm_type=2,
        pixel_values_videos=pixels["pixel_values_videos"].float(), video_grid_thw=pixels["video_grid_thw"],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst", help="output directory (the INT8 checkpoint when --int8 is given)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="JSON with Qwen4ExpTextConfig fields")
    parser.add_argument("--weight-seed", type=int, default=0, help="draws the weights (the hash seed is the config's)")
    parser.add_argument("--int8", action="store_true", help="quantize the PLE tables (writes DST-bf16 first)")
    parser.add_argument("--vision", action="store_true", help="a Qwen4ExpForConditionalGeneration (vision tower)")
    args = parser.parse_args(argv)
    if args.int8:
        print(make_tiny_int8_checkpoint(args.dst, args.config, args.weight_seed, vision=args.vision))
    else:
        make = make_tiny_vl_checkpoint if args.vision else make_tiny_checkpoint
        print(make(args.dst, args.config, args.weight_seed))


if __name__ == "__main__":
    main()
