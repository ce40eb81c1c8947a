"""Tiny random Qwen4Exp checkpoints for tests and the demo.

`python -m qwen4_exp_hcu.tiny DST [--int8] [--config CONFIG.json] [--weight-seed 0]` writes a text-only
`Qwen4ExpForCausalLM` with transformers' own `save_pretrained` (so the layout is exactly what transformers
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
# Share of each lm_head row that points at the embedding of the token it predicts next (see below).
SUCCESSOR_WEIGHT = 0.6


def load_config(config_path: str | Path = DEFAULT_CONFIG, **overrides):
    """`Qwen4ExpTextConfig` from a JSON file, with keyword overrides (e.g. `ple_layer_ids=[]`)."""
    from transformers import Qwen4ExpTextConfig

    values = json.loads(Path(config_path).read_text())
    values.update(overrides)
    values.pop("model_type", None)
    return Qwen4ExpTextConfig(**values)


def build_tokenizer(vocab_size: int, eos_token_id: int, bos_token_id: int, pad_token_id: int):
    """A word-level tokenizer: specials, then `t{i}` for every other id; made in code, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {pad_token_id: "<pad>", eos_token_id: "<eos>", bos_token_id: "<bos>"}
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
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
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
        elif "embed" in name:
            param.copy_(torch.randn(param.shape, generator=gen))
        elif name.endswith("conv1d.weight"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
        else:
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
    _make_greedy_unambiguous_(model, gen)


@torch.no_grad()
def _make_greedy_unambiguous_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Give greedy decoding a margin far above bf16 noise, keeping every logit context-dependent.

    A random lm_head gives near-uniform logits over 512 tokens: ~1.6% of greedy steps are decided by a
    gap smaller than the bf16 rounding differences between two correct implementations, so token
    parity between vLLM (bf16) and transformers would be luck. Each lm_head row is therefore a blend of
    a random direction (context-dependent logits) and the embedding of the token it follows in a fixed
    512-cycle, which makes that successor the argmax by a wide margin. Continuations stay distinct per
    prompt and never repeat a token within 512 steps; logprobs still depend on the whole network.
    """
    embed = model.model.embed_tokens.weight.float()
    vocab = embed.shape[0]
    order = torch.randperm(vocab, generator=gen)
    previous = torch.empty_like(order)
    previous[order] = order.roll(1)  # the token each token follows in the cycle
    successor_rows = embed[previous]
    lm_head = model.lm_head.weight
    unit = lambda w: w / w.norm(dim=1, keepdim=True)  # noqa: E731
    scale = math.sqrt(embed.shape[1]) / 4
    lm_head.copy_(scale * (SUCCESSOR_WEIGHT * unit(successor_rows) + (1 - SUCCESSOR_WEIGHT) * unit(lm_head.float())))


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


def make_tiny_int8_checkpoint(
    dst: str | Path, config_path: str | Path = DEFAULT_CONFIG, weight_seed: int = 0, **overrides
) -> Path:
    """BF16 checkpoint at `DST-bf16`, then the quantizer's INT8-PLE copy at `dst`; returns `dst`."""
    from qwen4_exp_hcu.quantize import quantize_checkpoint

    dst = Path(dst)
    bf16 = make_tiny_checkpoint(dst.with_name(f"{dst.name}-bf16"), config_path, weight_seed, **overrides)
    quantize_checkpoint(bf16, dst)
    return dst


def dequantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Copy of an INT8-PLE checkpoint with every table shard dequantized to BF16 (`int8 * scale`, the
    row format's reference) and no quantization config: what transformers runs as the INT8 oracle."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from qwen4_exp_hcu.names import SCALE_SUFFIX
    from qwen4_exp_hcu.ple.int8 import dequantize_rows

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


@torch.no_grad()
def reference_greedy(path: str | Path, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """transformers' greedy continuation of each prompt, with fp32 weights (the most exact oracle).

    Every step re-runs the whole sequence without a cache and never stops or masks at EOS (like vLLM's
    `ignore_eos`). Returns per prompt the tokens and the `[max_new_tokens, vocab]` log-probabilities.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        seq, rows = list(prompt), []
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            rows.append(logits.log_softmax(-1))
            seq.append(int(logits.argmax()))
        results.append({"tokens": seq[len(prompt) :], "logprobs": torch.stack(rows)})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst", help="output directory (the INT8 checkpoint when --int8 is given)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="JSON with Qwen4ExpTextConfig fields")
    parser.add_argument("--weight-seed", type=int, default=0, help="draws the weights (the hash seed is the config's)")
    parser.add_argument("--int8", action="store_true", help="quantize the PLE tables (writes DST-bf16 first)")
    args = parser.parse_args(argv)
    make = make_tiny_int8_checkpoint if args.int8 else make_tiny_checkpoint
    print(make(args.dst, args.config, args.weight_seed))


if __name__ == "__main__":
    main()
