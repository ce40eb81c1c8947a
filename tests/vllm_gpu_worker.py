"""One vLLM engine on a GPU in one CUDA-graph mode: run the parity scenarios, write the outputs as JSON.

Run by `tests/test_vllm_gpu.py`, one subprocess per (mode, prefetch), because vLLM reads its graph settings
(`VLLM_USE_BREAKABLE_CUDAGRAPH`, cached envs) once per process. The engine runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so `--fault` can break the PLE state carry here and nowhere else, and
`--rows-fault F` can read every PLE row F times too large (`helpers.faults.scale_table_rows`: the row fault the
bounds are set against).
`--emulate-precision-casts` asks Inductor to round its fused kernels' intermediates to bf16 as eager does (torch.compile
modes only; they then give eager's figures: their larger errors are that rounding).

    python tests/vllm_gpu_worker.py CHECKPOINT OUT.json --mode breakable [--no-prefetch] [--fault] [--rows-fault 1.1]
        [--emulate-precision-casts]
"""

import argparse
import json
import os
import sys
import time

MODES = {
    # vLLM 0.33's default for Qwen4Exp architectures: it turns breakable CUDA graphs on by itself.
    "breakable": ({}, {}),
    "full_and_piecewise": (
        {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"},
        {"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}},
    ),
    "piecewise": ({"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}, {"compilation_config": {"mode": 3, "cudagraph_mode": "PIECEWISE"}}),
    "full_decode_only": (
        {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"},
        {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
    ),
    "eager": ({}, {"enforce_eager": True}),
    # vLLM's default graphs with the opt-in GPU cache of hot PLE rows, filled from served traffic
    "hot_rows": ({}, {"additional_config": {"qwen4_exp_hcu": {"hot_rows_gib": 0.01}}}),
}
HOT_ROWS_REFRESH_EVERY = 2  # lookups between refreshes in the hot_rows mode, so the short runs refresh often


def breakable_cudagraphs(vllm_config) -> bool:
    """Whether the engine built from `vllm_config` runs breakable CUDA graphs: resolved into the compilation
    config where vLLM keeps it there, otherwise set in the environment while the config is built."""
    resolved = getattr(vllm_config.compilation_config, "use_breakable_cudagraph", None)
    return resolved if resolved is not None else os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "1"


def engine_kwargs(mode: str, emulate_precision_casts: bool = False) -> dict:
    """The portable GPU settings with the mode's own (its compilation settings added to them)."""
    from helpers.scenarios import GPU_ENGINE

    kwargs = {**GPU_ENGINE, **MODES[mode][1]}
    for merged in ("compilation_config", "additional_config"):
        kwargs[merged] = {**GPU_ENGINE[merged], **MODES[mode][1].get(merged, {})}
    if emulate_precision_casts:
        kwargs["compilation_config"]["inductor_compile_config"] = {"emulate_precision_casts": True}
    return kwargs


def top_logprobs(output) -> list[list[list[float]]]:
    return [[[tok, lp.logprob] for tok, lp in step.items()] for step in output.logprobs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--no-prefetch", action="store_true")
    parser.add_argument("--fault", action="store_true")
    parser.add_argument("--rows-fault", type=float, default=None, metavar="FACTOR")
    parser.add_argument("--emulate-precision-casts", action="store_true")
    args = parser.parse_args()

    env, _ = MODES[args.mode]
    os.environ.update(env)
    os.environ["QWEN4_EXP_HCU_PREFETCH"] = "0" if args.no_prefetch else "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function to the worker
    if args.fault or args.rows_fault is not None:
        from helpers.faults import UNCACHED

        os.environ.update(UNCACHED)
    if args.fault:
        from helpers.faults import break_state_carry

        break_state_carry()
    if args.rows_fault is not None:
        from helpers.faults import scale_table_rows

        scale_table_rows(factor=args.rows_fault)
    if args.mode == "hot_rows":
        from qwen4_exp_hcu.ple.tiers import hot_rows

        hot_rows.REFRESH_EVERY = HOT_ROWS_REFRESH_EVERY

    from helpers.scenarios import MAX_NEW_TOKENS, PROMPTS, prefix_prompt
    from helpers.tiny_engine import SETTINGS
    from vllm import LLM, SamplingParams

    from qwen4_exp_hcu.model.model import report_ple_tables

    t0 = time.monotonic()
    llm = LLM(
        model=args.checkpoint,
        **SETTINGS,
        gpu_memory_utilization=0.1,
        **engine_kwargs(args.mode, args.emulate_precision_casts),
    )
    startup_s = time.monotonic() - t0
    config = llm.llm_engine.vllm_config.compilation_config

    def run(prompts, max_tokens=MAX_NEW_TOKENS):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [
            {"tokens": list(o.outputs[0].token_ids), "logprobs": top_logprobs(o.outputs[0]),
             "num_cached_tokens": o.num_cached_tokens or 0}
            for o in outs
        ]  # fmt: skip

    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    result = {
        "mode": args.mode,
        "prefetch": not args.no_prefetch,
        "fault": args.fault,
        "rows_fault": args.rows_fault,
        "emulate_precision_casts": args.emulate_precision_casts,
        "breakable": breakable_cudagraphs(llm.llm_engine.vllm_config),
        "cudagraph_mode": str(config.cudagraph_mode.name),
        "compilation_mode": str(config.mode.name),
        "startup_s": round(startup_s, 1),
        "one_at_a_time": [run([p])[0] for p in PROMPTS],
        "concurrent": run(PROMPTS),
        "block_size": block_size,
        "prefix_cache": [run([prefix_prompt(block_size)], 8)[0] for _ in range(2)],
        "tables": llm.apply_model(report_ple_tables)[0]["now"],
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown; the result is written


if __name__ == "__main__":
    main()
