"""PLELayer under speculative decoding: verify k drafts per request, accept a random prefix, repeat.

The reference runs the same layer without speculation on the accepted tokens only, one by one. Every
accepted position's output and the state after each round (read at the accepted length) must equal it
bit for bit. A row's matmul result may depend on how many rows share the call, so the layer's projections,
table rows and hidden states hold small integers: every matmul is then exact in fp32, in any batch.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.configs import EOS, tiny_text_config
from helpers.layers import make_pair
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState

CFG = tiny_text_config(ngram_size=3)
_, LAYER = make_pair(CFG)
C = CFG.hidden_size * CFG.hc_count
_INTS = torch.Generator().manual_seed(0)
with torch.no_grad():
    for weight in (LAYER.key_proj.weight, LAYER.value_proj.weight, LAYER.table.weight):
        weight.copy_(torch.randint(-2, 3, weight.shape, generator=_INTS))
SLOTS = 4


def tokens(data, n):
    return data.draw(st.lists(st.sampled_from([EOS, 3, 4, 5, 50, 96]), min_size=n, max_size=n))


def current(state: PLEState, slot: int, accepted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (n-gram context, conv window) a request reads: from offset accepted - 1."""
    ctx, window = LAYER.state_shapes()
    return (state.ngram[slot, accepted - 1 : accepted - 1 + ctx[0]], state.conv[slot, accepted - 1 : accepted - 1 + window[0]])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), extra=st.integers(1, 4), num_requests=st.integers(1, 3))
def test_verify_then_accept_equals_running_the_accepted_tokens_one_by_one(data, extra, num_requests):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    slots = data.draw(st.permutations(range(SLOTS)))[:num_requests]
    spec = PLEState.zeros(LAYER.state_shapes(extra), SLOTS, torch.float32)
    seq = PLEState.zeros(LAYER.state_shapes(), SLOTS, torch.float32)
    hidden = lambda n: torch.randint(-3, 4, (n, C), generator=gen).float()  # noqa: E731

    # prefill (packed, both states), then rounds of verify + accept
    prompts = [tokens(data, data.draw(st.integers(1, 7))) for _ in slots]
    ids, hs = torch.tensor(sum(prompts, [])), hidden(sum(map(len, prompts)))
    lens = [len(p) for p in prompts]
    LAYER(hs, PLEBatch.from_lengths(ids, lens, slots, [False] * num_requests), spec)
    LAYER(hs, PLEBatch.from_lengths(ids, lens, slots, [False] * num_requests), seq)
    accepted = [1] * num_requests
    for _ in range(3):
        chunks = [tokens(data, 1 + data.draw(st.integers(0, extra))) for _ in slots]  # last token + drafts
        hs = hidden(sum(map(len, chunks)))
        batch = PLEBatch.from_lengths(
            torch.tensor(sum(chunks, [])), [len(c) for c in chunks], slots, [True] * num_requests,
            verify=[True] * num_requests, num_accepted=accepted,
        )  # fmt: skip
        out = LAYER(hs, batch, spec)
        accepted = [data.draw(st.integers(1, len(c))) for c in chunks]
        starts = batch.query_start_loc.tolist()
        for r, (slot, chunk, a) in enumerate(zip(slots, chunks, accepted)):
            for i in range(a):  # the reference sees only the accepted tokens, one at a time
                h = hs[starts[r] + i : starts[r] + i + 1]
                want = LAYER(h, PLEBatch.from_lengths(torch.tensor(chunk[i : i + 1]), [1], [slot], [True]), seq)
                # CPU GEMMs are not batch-invariant (one row vs a packed batch round differently): fp32 noise
                # only; a wrong state moves these by O(1) (see the next test)
                torch.testing.assert_close(out[starts[r] + i], want[0], rtol=1e-5, atol=1e-5, msg=f"{r, i}")
            want_ctx, want_window = current(seq, slot, 1)
            got_ctx, got_window = current(spec, slot, a)
            assert torch.equal(got_ctx, want_ctx), (r, a)
            torch.testing.assert_close(got_window, want_window, rtol=1e-5, atol=1e-5, msg=f"{r, a}")


def test_rejected_drafts_would_be_visible_without_num_accepted():
    """The comparison above is sensitive: reading the verified state from offset 0 (ignoring what was
    accepted) gives a different window as soon as a draft is accepted or rejected."""
    spec = PLEState.zeros(LAYER.state_shapes(2), 1, torch.float32)
    gen = torch.Generator().manual_seed(0)
    hs = torch.randint(-3, 4, (4, C), generator=gen).float()
    LAYER(hs, PLEBatch.from_lengths(torch.tensor([3, 4, 5, 50]), [4], [0], [False]), spec)
    LAYER(hs[:3], PLEBatch.from_lengths(torch.tensor([5, 96, 4]), [3], [0], [True], verify=[True]), spec)
    assert not torch.allclose(current(spec, 0, 1)[1], current(spec, 0, 2)[1], rtol=1e-5, atol=1e-5)  # beyond the tolerance
    assert not torch.equal(current(spec, 0, 1)[0], current(spec, 0, 3)[0])


def test_speculation_inputs_are_checked():
    state = PLEState.zeros(LAYER.state_shapes(2), 1, torch.float32)
    hs = torch.zeros(4, C)
    ids = torch.tensor([3, 4, 5, 50])
    with pytest.raises(ValueError, match="num_accepted"):
        LAYER(hs[:1], PLEBatch.from_lengths(ids[:1], [1], [0], [True], num_accepted=[4]), state)
    with pytest.raises(ValueError, match="verifying request"):
        LAYER(hs, PLEBatch.from_lengths(ids, [4], [0], [True], verify=[True]), state)


@pytest.mark.cpu_only
def test_the_layer_kernels_serve_it_as_its_references(monkeypatch):
    """Prefill, then rounds of verified drafts, through the layer as the CPU serves it (the torch references of
    `kernels.ple_gate` and `kernels.short_conv`) and with those kernels forced (Triton's interpreter): the same
    outputs and conv windows to fp32 rounding (the norms' sums run in another order), the same n-gram context."""
    import qwen4_exp_hcu.ple.layer as layer_module

    def run():
        gen = torch.Generator().manual_seed(5)
        state = PLEState.zeros(LAYER.state_shapes(2), SLOTS, torch.float32)
        slots, outs = [2, 0, 3], []
        lens, accepted = [5, 1, 3], None
        for step in range(3):
            ids = torch.randint(0, 97, (sum(lens),), generator=gen)
            hs = torch.randint(-3, 4, (sum(lens), C), generator=gen).float()
            batch = PLEBatch.from_lengths(ids, lens, slots, [step > 0] * 3, verify=[step > 0] * 3, num_accepted=accepted)
            outs.append(LAYER(hs, batch, state))
            lens, accepted = [3, 2, 1], [2, 1, 1]
        return outs, state

    want_outs, want_state = run()
    monkeypatch.setattr(layer_module, "dispatch", lambda launcher, reference, *args, **kwargs: launcher(*args, **kwargs))
    got_outs, got_state = run()
    for got, want in zip(got_outs, want_outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_state.ngram, want_state.ngram)
    torch.testing.assert_close(got_state.conv, want_state.conv, rtol=1e-5, atol=1e-5)
