"""vLLM's own Qwen4Exp class beside ours on one checkpoint: top-5 logprobs of the same greedy runs.

    python -m benchmarks.peer_logprobs CKPT --out DIR [--eager] [--long]

Each engine runs in its own process (`QWEN4_EXP_HCU_DISABLE=1` keeps vLLM's own class there); the parent
compares: for every step and every token of ours' top-5 that upstream's top-5 also holds, |ours - upstream|.
An oracle that does not go through transformers. Writes DIR/peer_logprobs.json.

`--long`: the prompts of `tests/test_vllm_long_context.py` (3 000, 5 000 and 8 000 tokens beyond the QSA indexer
budget, two short ones decoding beside them, steps of 1 024 tokens), for a checkpoint whose attention is sharpened
(`make_long_checkpoint`: random weights alone attend almost uniformly, so which blocks QSA keeps hardly matters):
both classes then run vLLM's QSA attention beyond the budget, and the report gives each prompt's error.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks.common import commit

# What the GPU machine's Python-only vLLM 0.33 (../shared/gpu-vllm) runs: no compiled FlashAttention/FlashInfer/_C ops.
GPU_ENGINE = {"attention_config": {"backend": "TRITON_ATTN"}, "additional_config": {"gdn_prefill_backend": "triton"},
              "compilation_config": {"custom_ops": ["none"]}, "kv_cache_memory_bytes": 256 << 20}  # fmt: skip
PROMPTS = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 13, 17, 19, 23], list(range(100, 160))]
LONG_LENGTHS = (3000, 5000, 8000, 5, 40)  # tests/test_vllm_long_context.py's batch
LONG_BUDGET, LONG_MAX_MODEL_LEN = 2048, 8192 + 64


def prompts(long: bool) -> list[list[int]]:
    if not long:
        return PROMPTS
    import torch

    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in LONG_LENGTHS]


def make_long_checkpoint(dst: str) -> Path:
    """The tiny BF16 checkpoint with the release's indexer budget and room for the long prompts, its attention and
    indexer sharpened as the long-context test's is (`helpers.checkpoints.sharpen_attention`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.checkpoints import sharpen_attention

    from qwen4_exp_hcu.tiny import make_tiny_checkpoint

    return sharpen_attention(make_tiny_checkpoint(dst, indexer_budget=LONG_BUDGET, max_position_embeddings=LONG_MAX_MODEL_LEN))


def run_engine(ckpt: str, eager: bool, long: bool = False) -> dict:
    from vllm import LLM, SamplingParams

    from benchmarks.common import upstream_padding_shard_passes

    if os.environ.get("QWEN4_EXP_HCU_DISABLE") == "1":
        upstream_padding_shard_passes()

    # upstream's class requires `output_gate_type` spelled out, as the releases do ("sigmoid"); transformers and
    # ours resolve an unset one to `hidden_act`: both sides get the release's value
    batch = prompts(long)
    shape = {"max_model_len": LONG_MAX_MODEL_LEN, "max_num_batched_tokens": 1024, "max_num_seqs": len(batch)} if long \
        else {"max_model_len": 256}
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function to the engine
    llm = LLM(model=ckpt, enforce_eager=eager, hf_overrides={"output_gate_type": "sigmoid"}, seed=0, **shape, **GPU_ENGINE)
    cls = llm.apply_model(lambda model: f"{type(model).__module__}.{type(model).__name__}")[0]
    attention = llm.apply_model(lambda model: sorted({type(m).__name__ for m in model.modules() if "Attention" in type(m).__name__}))[0]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5, ignore_eos=long)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    return {"class_module": cls, "attention_classes": attention, "runs": [
        {"tokens": list(o.outputs[0].token_ids),
         "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]} for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--long", action="store_true", help="prompts beyond the QSA indexer budget (a checkpoint "
                    "`make_long_checkpoint` wrote, or CKPT written so when it does not exist)")
    ap.add_argument("--side", choices=["ours", "upstream"])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = [f for f, on in (("--eager", args.eager), ("--long", args.long)) if on]
    if args.side:  # child: one engine
        (out / f"{args.side}.json").write_text(json.dumps(run_engine(args.ckpt, args.eager, args.long)))
        return
    if args.long and not Path(args.ckpt).exists():
        print("sharpened long-context checkpoint:", make_long_checkpoint(args.ckpt), flush=True)
    for side in ("upstream", "ours"):
        env = {**os.environ, "QWEN4_EXP_HCU_DISABLE": "1" if side == "upstream" else "0"}
        cmd = [sys.executable, "-m", "benchmarks.peer_logprobs", args.ckpt, "--out", str(out), "--side", side, *flags]
        rc = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1]).returncode
        print(f"{side}: exit {rc}", flush=True)
    sides = {s: json.loads((out / f"{s}.json").read_text()) for s in ("upstream", "ours") if (out / f"{s}.json").exists()}
    report = {"classes": {s: d["class_module"] for s, d in sides.items()},
              "attention_classes": {s: d.get("attention_classes") for s, d in sides.items()},
              "command": shlex.join(["python", "-m", "benchmarks.peer_logprobs", *sys.argv[1:]]), "commit": commit()}  # fmt: skip
    if len(sides) == 2:
        report.update(compare(sides["ours"]["runs"], sides["upstream"]["runs"], [len(p) for p in prompts(args.long)]))
    print(json.dumps(report, indent=1))
    (out / "peer_logprobs.json").write_text(json.dumps(report, indent=1))


def compare(ours: list[dict], upstream: list[dict], lengths: list[int]) -> dict:
    """|ours - upstream| over every step's top-5 entries both hold: overall, and per prompt (keyed by its length)."""
    errs, per_prompt, same_tokens = [], {}, 0
    for n, a, b in zip(lengths, ours, upstream, strict=True):
        same_tokens += a["tokens"] == b["tokens"]
        mine = [abs(v - sb[t]) for sa, sb in zip(a["logprobs"], b["logprobs"]) for t, v in sa.items() if t in sb]
        per_prompt[str(n)] = {"mean_abs": mean(mine), "max_abs": max(mine, default=None), "compared": len(mine)}
        errs += mine
    return {"prompts": len(lengths), "same_greedy_tokens": same_tokens, "compared": len(errs),
            "mean_abs": mean(errs), "max_abs": max(errs, default=None), "per_prompt": per_prompt}  # fmt: skip


def mean(errs: list[float]) -> float | None:
    """None where the two top-5 lists never share a token (`compared` 0 says so)."""
    return sum(errs) / len(errs) if errs else None


if __name__ == "__main__":
    main()
