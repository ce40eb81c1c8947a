"""PLELayer vs transformers' Qwen4ExpTextPLELayer: prefill + decode, chunking, packing, padding, errors."""

import pytest
import torch
from transformers import DynamicCache

from helpers.configs import EOS, tiny_text_config
from helpers.layers import make_pair
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState

ATOL = 2e-5


def empty_state(layer, slots, dtype=torch.float32, device="cpu"):
    return PLEState.zeros(layer.state_shapes(), slots, dtype, device)


def run(layer, hs, ids, lens, slots, state, has_init):
    return layer(hs, PLEBatch.from_lengths(ids, lens, slots, has_init), state)


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
    """Padding rows mapped to slot 0 would overwrite the state of the real request there."""
    cfg = tiny_text_config(ngram_size=3)
    _, ours = make_pair(cfg)
    C = cfg.hidden_size * cfg.hc_count
    alone = empty_state(ours, 4)
    x0, t0 = torch.randn(5, C), torch.randint(0, 97, (5,))
    out_alone = run(ours, x0, t0, [5], [0], alone, [False])
    # same request in slot 0, beside two padding requests (slot -1) and 3 padding tokens past qsl[-1]
    padded = empty_state(ours, 4)
    for s in (padded.ngram, padded.conv):
        s[1:].fill_(7)  # other slots hold data that must stay as it is
    before = padded.clone()
    hs = torch.cat([x0, torch.randn(2 + 3, C)])
    ids = torch.cat([t0, torch.randint(0, 97, (5,))])
    out = run(ours, hs, ids, [5, 1, 1], [0, -1, -1], padded, [False, True, True])
    assert torch.equal(padded.ngram[0], alone.ngram[0])
    torch.testing.assert_close(padded.conv[0], alone.conv[0], atol=ATOL, rtol=0)  # matmuls of other sizes round differently
    for s, b in ((padded.ngram, before.ngram), (padded.conv, before.conv)):
        assert torch.equal(s[1:], b[1:])
    # the real request computes what it computes alone; each padding request (slot -1) reads no slot: it
    # computes what a new request with its one token computes (slot 0 holds zeros, not the EOS context)
    torch.testing.assert_close(out[:5], out_alone, atol=ATOL, rtol=0)
    for i in (5, 6):
        want = run(ours, hs[i : i + 1], ids[i : i + 1], [1], [0], empty_state(ours, 1), [False])
        torch.testing.assert_close(out[i : i + 1], want, atol=ATOL, rtol=0)


def test_bad_inputs_named():
    cfg = tiny_text_config()
    _, ours = make_pair(cfg)
    C = cfg.hidden_size * cfg.hc_count
    state = empty_state(ours, 2)
    ctx, conv = state.ngram, state.conv
    hs, ids = torch.randn(4, C), torch.randint(0, 97, (4,))
    batch = PLEBatch.from_lengths(ids, [4], [0], [False])
    qsl, slots, init = batch.query_start_loc, batch.slot_ids, batch.has_initial_state
    cases = [
        ((hs, batch, PLEState(ctx.int(), conv)), "ngram_state"),
        ((hs, batch, PLEState(ctx, conv[:, :2])), "conv_state"),
        ((hs, batch, PLEState(ctx, conv.double())), "conv_state"),
        ((hs, PLEBatch(ids, qsl, slots, init.int()), state), "has_initial_state"),
        ((hs, PLEBatch(ids[:3], qsl, slots, init), state), "input_ids"),
        ((hs, PLEBatch(ids, torch.tensor([0, 5]), slots, init), state), "query_start_loc"),
        ((hs, PLEBatch(ids, torch.tensor([0, 3, 2]), torch.tensor([0, 1]), torch.tensor([False, False])), state), "non-decreasing"),
        ((hs, PLEBatch(ids, qsl, torch.tensor([2]), init), state), "slot_ids"),
        ((hs[:, :-1], batch, state), "hc\\*hidden"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            ours(*args)


def test_load_errors_named():
    cfg = tiny_text_config()
    hf, _ = make_pair(cfg)
    from qwen4_exp_hcu.ple.layer import PLELayer
    from qwen4_exp_hcu.ple.storage import PLEStorage

    layer = PLELayer(cfg, 1, PLEStorage("int8"), dtype=torch.float32)
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
    _, gpu = make_pair(cfg, quantized=True, device="cuda", host=True)
    assert gpu.table.weight.is_pinned()
    C = cfg.hidden_size * cfg.hc_count
    st_c, st_g = empty_state(cpu, 4), empty_state(gpu, 4, device="cuda")
    for step, lens in enumerate([[6, 3], [1, 1], [2, 1]]):
        hs, ids = torch.randn(sum(lens), C), torch.randint(0, 97, (sum(lens),))
        a = run(cpu, hs, ids, lens, [1, 3], st_c, [step > 0] * 2)
        b = run(gpu, hs.cuda(), ids.cuda(), lens, [1, 3], st_g, [step > 0] * 2)
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4)
        assert torch.equal(st_g.ngram.cpu(), st_c.ngram)


def test_standalone_layer_imports_no_config_parsers():
    """Notebooks import the layer without vLLM, pydantic or compressed-tensors (config parsing lives elsewhere)."""
    import subprocess
    import sys

    code = "import sys, qwen4_exp_hcu.ple.layer, qwen4_exp_hcu.ple.prefetch; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for heavy in ("vllm", "pydantic", "compressed_tensors"):
        assert f"'{heavy}'" not in loaded, heavy


@pytest.mark.gpu
def test_gpu_hot_rows_from_calibration_change_nothing_but_where_rows_are_read():
    """`PLELayer.enable_hot_rows` with calibration tokens: the hash of the stream picks the cached rows;
    lookups through the cache equal those without it."""
    cfg = tiny_text_config(ngram_size=3)
    _, gpu = make_pair(cfg, quantized=True, device="cuda", host=True)
    state = empty_state(gpu, 2, device="cuda")
    ids = torch.randint(0, 97, (40,), device="cuda")
    batch = PLEBatch.from_lengths(ids, [30, 10], [0, 1], [False, False])
    plain = gpu.lookup(batch, state).clone()
    hot = gpu.enable_hot_rows(1 << 20, calibration_tokens=ids.cpu())
    assert hot.share == 1.0 and int((hot.slot_row >= 0).sum()) > 0  # small table: every calibration row fits
    assert torch.equal(gpu.lookup(batch, state), plain)
    with pytest.raises(ValueError, match="cannot hold the row map"):
        gpu.enable_hot_rows(16)


def test_a_wrong_int8_row_scale_is_caught():
    """INT8 row scales 1% too large (a wrong table scale): the comparison with transformers must fail."""
    cfg = tiny_text_config(ngram_size=3)
    hf, ours = make_pair(cfg, quantized=True)
    ours.table.scale.mul_(1.01)
    prompt = torch.tensor([5, 6, EOS, 8, 9, 10, 11])
    hs = torch.randn(len(prompt), cfg.hidden_size * cfg.hc_count)
    with torch.no_grad():
        want = hf(hs[None], prompt[None], DynamicCache(config=cfg))[0]
    err = (run(ours, hs, prompt, [len(prompt)], [2], empty_state(ours, 4), [False]) - want).abs().max().item()
    print(f"SCALE-FAULT max|diff| {err:.3g} vs atol {ATOL}")
    assert err > ATOL
