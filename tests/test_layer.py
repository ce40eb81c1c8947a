"""PLELayer vs transformers' Qwen4ExpTextPLELayer: prefill + decode, chunking, packing, padding, errors."""

import pytest
import torch
from transformers import DynamicCache

from layer_utils import empty_state, make_pair
from ple_configs import EOS, tiny_text_config
from qwen4_exp_hcu.kernels.state_scatter import scatter_rows, scatter_rows_reference

ATOL = 2e-5


def qsl_of(lens):
    return torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32)


def run(layer, hs, ids, lens, slots, state, has_init):
    return layer(hs, ids, qsl_of(lens), torch.tensor(slots), *state, torch.tensor(has_init))


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("ngram_size", [2, 3])
def test_prefill_then_decode_equals_transformers(quantized, ngram_size):
    cfg = tiny_text_config(ngram_size=ngram_size)
    hf, ours = make_pair(cfg, quantized=quantized)
    C = cfg.hidden_size * cfg.hc_count
    cache = DynamicCache(config=cfg)
    state = empty_state(ours, 4)
    prompt = torch.tensor([5, 6, EOS, 8, 9, 10, 11])
    hs = torch.randn(len(prompt), C)
    with torch.no_grad():
        want = hf(hs[None], prompt[None], cache)[0]
    got = run(ours, hs, prompt, [len(prompt)], [2], state, [False])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for _ in range(10):
        tok, h = torch.randint(0, 97, (1,)), torch.randn(1, C)
        with torch.no_grad():
            want = hf(h[None], tok[None], cache)[0]
        got = run(ours, h, tok, [1], [2], state, [True])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_chunked_prefill_and_packing_equal_one_shot():
    cfg = tiny_text_config(ngram_size=3)
    hf, ours = make_pair(cfg, quantized=True)
    C = cfg.hidden_size * cfg.hc_count
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (13, 1, 9)]
    prompts[0][4] = EOS
    hss = [torch.randn(len(p), C, generator=gen) for p in prompts]
    with torch.no_grad():
        want = [hf(h[None], p[None], None)[0] for h, p in zip(hss, prompts)]
    # all three packed in chunks of up to 4 tokens per step, in slots 3, 0, 5 of an 6-slot cache
    state, slots = empty_state(ours, 6), [3, 0, 5]
    done, got = [0, 0, 0], [[], [], []]
    while any(d < len(p) for d, p in zip(done, prompts)):
        lens = [min(4, len(p) - d) for d, p in zip(done, prompts)]
        ids = torch.cat([p[d : d + n] for p, d, n in zip(prompts, done, lens)])
        hs = torch.cat([h[d : d + n] for h, d, n in zip(hss, done, lens)])
        out = run(ours, hs, ids, lens, slots, state, [d > 0 for d in done])
        for r, piece in enumerate(out.split(lens)):
            got[r].append(piece)
            done[r] += lens[r]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.cat(g), w, atol=ATOL, rtol=0)


def test_padding_never_touches_a_real_request_in_slot_0():
    """Defect #5 of the earlier implementation: padding rows mapped to slot 0 overwrote its state."""
    cfg = tiny_text_config(ngram_size=3)
    _, ours = make_pair(cfg)
    C = cfg.hidden_size * cfg.hc_count
    alone = empty_state(ours, 4)
    x0, t0 = torch.randn(5, C), torch.randint(0, 97, (5,))
    run(ours, x0, t0, [5], [0], alone, [False])
    # same request in slot 0, beside two padding requests (slot -1) and 3 padding tokens past qsl[-1]
    padded = empty_state(ours, 4)
    for s in padded:
        s[1:].fill_(7)  # other slots hold data that must stay as it is
    before = [s.clone() for s in padded]
    hs = torch.cat([x0, torch.randn(2 + 3, C)])
    ids = torch.cat([t0, torch.randint(0, 97, (5,))])
    out = run(ours, hs, ids, [5, 1, 1], [0, -1, -1], padded, [False, True, True])
    assert torch.equal(padded[0][0], alone[0][0])
    torch.testing.assert_close(padded[1][0], alone[1][0], atol=ATOL, rtol=0)  # matmuls of other sizes round differently
    for s, b in zip(padded, before):
        assert torch.equal(s[1:], b[1:])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("seed", range(3))
def test_state_scatter_kernel_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(6, 3, 5, generator=g)
    slots = torch.tensor([4, -1, 0, -1, 2, 9])  # padding and an out-of-range slot write nothing
    src = torch.randn(6, 3, 5, generator=g)
    assert torch.equal(scatter_rows(dst.clone(), slots, src), scatter_rows_reference(dst.clone(), slots, src))


def test_bad_inputs_named():
    cfg = tiny_text_config()
    _, ours = make_pair(cfg)
    C = cfg.hidden_size * cfg.hc_count
    ctx, conv = empty_state(ours, 2)
    hs, ids = torch.randn(4, C), torch.randint(0, 97, (4,))
    qsl, slots, init = qsl_of([4]), torch.tensor([0]), torch.tensor([False])
    cases = [
        ((hs, ids, qsl, slots, ctx.int(), conv, init), "ngram_state"),
        ((hs, ids, qsl, slots, ctx, conv[:, :2], init), "conv_state"),
        ((hs, ids, qsl, slots, ctx, conv.double(), init), "conv_state"),
        ((hs, ids, qsl, slots, ctx, conv, init.int()), "has_initial_state"),
        ((hs, ids[:3], qsl, slots, ctx, conv, init), "input_ids"),
        ((hs, ids, torch.tensor([0, 5]), slots, ctx, conv, init), "query_start_loc"),
        ((hs, ids, torch.tensor([0, 3, 2]), torch.tensor([0, 1]), ctx, conv, torch.tensor([False, False])), "non-decreasing"),
        ((hs, ids, qsl, torch.tensor([2]), ctx, conv, init), "slot_ids"),
        ((hs[:, :-1], ids, qsl, slots, ctx, conv, init), "hc\\*hidden"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            ours(*args)


def test_load_errors_named():
    cfg = tiny_text_config()
    hf, _ = make_pair(cfg)
    from qwen4_exp_hcu.ple.layer import PLELayer

    layer = PLELayer(cfg, 1, quantized=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="ple.ple_embedding.layer_multipliers"):
        layer.load_weight("ple_embedding.layer_multipliers", torch.tensor([1, 2, 3]), "model.layers.2.ple.")
    with pytest.raises(ValueError, match="model.layers.2.ple.key_proj.weight"):
        layer.load_weight("key_proj.weight", torch.zeros(3, 3), "model.layers.2.ple.")
    q = torch.zeros(layer.table.shard_rows, layer.spec.head_dim, dtype=torch.int8)
    layer.load_weight("ple_embedding.ngram_embedding.shard_0.weight", q, "model.layers.2.ple.")
    with pytest.raises(ValueError, match="shard_0.weight_scale is missing"):
        layer.finish_loading("model.layers.2.ple.")
    layer.load_weight("ple_embedding.ngram_embedding.shard_0.weight_scale", torch.ones(len(q), 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"shards \[1, 2, 3\] were never loaded"):
        layer.finish_loading()


@pytest.mark.gpu
def test_gpu_layer_with_host_table_matches_cpu():
    cfg = tiny_text_config(ngram_size=3)
    _, cpu = make_pair(cfg, quantized=True)
    _, gpu = make_pair(cfg, quantized=True, device="cuda", host_table=True)
    assert gpu.table.weight.is_pinned()
    C = cfg.hidden_size * cfg.hc_count
    st_c, st_g = empty_state(cpu, 4), empty_state(gpu, 4, device="cuda")
    for step, lens in enumerate([[6, 3], [1, 1], [2, 1]]):
        hs, ids = torch.randn(sum(lens), C), torch.randint(0, 97, (sum(lens),))
        a = run(cpu, hs, ids, lens, [1, 3], st_c, [step > 0] * 2)
        b = gpu(hs.cuda(), ids.cuda(), qsl_of(lens).cuda(), torch.tensor([1, 3]).cuda(), *st_g, torch.tensor([step > 0] * 2).cuda())
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4)
        assert torch.equal(st_g[0].cpu(), st_c[0])
