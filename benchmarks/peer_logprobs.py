"""vLLM 0.33's own Qwen4Exp class beside ours on one checkpoint: top-5 logprobs of the same greedy runs.

    python -m benchmarks.peer_logprobs CKPT --out DIR [--eager]

Each engine runs in its own process (`QWEN4_EXP_HCU_DISABLE=1` keeps vLLM's own class there); the parent
compares: for every step and every token of ours' top-5 that upstream's top-5 also holds, |ours - upstream|.
An oracle that does not go through transformers. Writes DIR/peer_logprobs.json.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# What the GPU machine's Python-only vLLM 0.33 (../shared/gpu-vllm) runs: no compiled FlashAttention/FlashInfer/_C ops.
GPU_ENGINE = {"attention_config": {"backend": "TRITON_ATTN"}, "additional_config": {"gdn_prefill_backend": "triton"},
              "compilation_config": {"custom_ops": ["none"]}, "kv_cache_memory_bytes": 256 << 20}  # fmt: skip
PROMPTS = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 13, 17, 19, 23], list(range(100, 160))]


def run_engine(ckpt: str, eager: bool) -> dict:
    from vllm import LLM, SamplingParams

    from benchmarks.common import upstream_padding_shard_passes

    if os.environ.get("QWEN4_EXP_HCU_DISABLE") == "1":
        upstream_padding_shard_passes()

    # upstream's class requires `output_gate_type` spelled out, as the releases do ("sigmoid"); transformers and
    # ours resolve an unset one to `hidden_act`: both sides get the release's value
    llm = LLM(model=ckpt, max_model_len=256, enforce_eager=eager, hf_overrides={"output_gate_type": "sigmoid"}, **GPU_ENGINE)
    cls = llm.apply_model(lambda model: f"{type(model).__module__}.{type(model).__name__}")[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=16, temperature=0, logprobs=5))
    return {"class_module": cls, "runs": [
        {"tokens": list(o.outputs[0].token_ids),
         "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]} for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--side", choices=["ours", "upstream"])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.side:  # child: one engine
        (out / f"{args.side}.json").write_text(json.dumps(run_engine(args.ckpt, args.eager)))
        return
    for side in ("upstream", "ours"):
        env = {**os.environ, "QWEN4_EXP_HCU_DISABLE": "1" if side == "upstream" else "0"}
        cmd = [sys.executable, "-m", "benchmarks.peer_logprobs", args.ckpt, "--out", str(out), "--side", side]
        rc = subprocess.run(cmd + (["--eager"] if args.eager else []), env=env, cwd=Path(__file__).parents[1]).returncode
        print(f"{side}: exit {rc}", flush=True)
    sides = {s: json.loads((out / f"{s}.json").read_text()) for s in ("upstream", "ours") if (out / f"{s}.json").exists()}
    report = {"classes": {s: d["class_module"] for s, d in sides.items()}}
    if len(sides) == 2:
        errs, same_tokens = [], 0
        for a, b in zip(sides["ours"]["runs"], sides["upstream"]["runs"]):
            same_tokens += a["tokens"] == b["tokens"]
            for sa, sb in zip(a["logprobs"], b["logprobs"]):
                errs += [abs(v - sb[t]) for t, v in sa.items() if t in sb]
        report.update(prompts=len(PROMPTS), same_greedy_tokens=same_tokens, compared=len(errs),
                      mean_abs=sum(errs) / len(errs), max_abs=max(errs))
    print(json.dumps(report, indent=1))
    (out / "peer_logprobs.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
