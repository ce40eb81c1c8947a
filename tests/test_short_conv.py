"""The PLE layer's window kernels (`kernels.short_conv`) against their torch references, on the CPU under
Triton's interpreter and on a GPU: batches mixing new, continuing and padding requests, prefill chunks and decode
tokens, speculative layouts (drafts verified, an accepted count per request), states whose slots are strided.
The window store is exact (it moves values); the conv's fp32 result, rounded once where the reference rounds each
tap in bf16, agrees to two bf16 steps of its largest value."""

import pytest
import torch

from qwen4_exp_hcu.kernels.short_conv import short_conv, short_conv_reference, store_window, store_window_reference

DEVICES = [pytest.param("cpu", marks=pytest.mark.cpu_only), pytest.param("cuda", marks=pytest.mark.gpu)]
K, DILATION, C = 4, 3, 40
L = (K - 1) * DILATION


def _batch(seed: int, speculative: bool, device: str):
    """Five requests: a new prompt, a continuing prompt chunk, two decode tokens (verifying drafts when
    `speculative`), a padding request; slots shuffled, every state slot strided (one spare entry per slot)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 5, 3 if speculative else 1, 1, 2]
    slots = [4, 0, 2, 5, -1]
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch = dict(
        qsl=qsl, slot_ids=torch.tensor(slots), has_initial_state=torch.tensor([False, True, True, True, False]),
        num_accepted=torch.tensor([1, 1, 2, 3, 1], dtype=torch.int32) if speculative else None,
        verify=torch.tensor([False, False, True, True, False]) if speculative else None,
    )  # fmt: skip
    extra = 2 if speculative else 0
    conv = torch.randn(6, L + extra + 1, C, generator=g).bfloat16()[:, : L + extra]  # strided slots
    ngram = torch.randint(0, 1000, (6, 2 + extra + 1), generator=g)[:, : 2 + extra]
    x = torch.randn(int(qsl[-1]), C, generator=g).bfloat16()
    ids = torch.randint(0, 1000, (int(qsl[-1]),), generator=g)
    to = lambda t: t if t is None else t.to(device)  # noqa: E731
    return {k: to(v) for k, v in batch.items()}, to(conv), to(ngram), to(x), to(ids)


def _assert_close(got, want):
    step = 2.0**-7 * want.float().abs().max().item()
    torch.testing.assert_close(got, want, rtol=2.0**-7, atol=2 * step)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_store_window_matches_reference(device, speculative, seed):
    b, conv, ngram, x, ids = _batch(seed, speculative, device)
    args = (b["qsl"], b["slot_ids"], b["has_initial_state"], b["num_accepted"], b["verify"])
    for state, chunk, length, fill in ((conv, x, L, 0), (ngram, ids, 2, 7), (ngram, ids, 2, 1)):
        want = store_window_reference(state.clone(), chunk, *args, length, fill)
        got = store_window(state.clone(), chunk, *args, length, fill)
        assert torch.equal(got, want)
        assert torch.equal(got[3], state[3]) and torch.equal(got[1], state[1])  # unused slots untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_short_conv_matches_reference(device, speculative, seed):
    b, conv, _, x, _ = _batch(seed, speculative, device)
    g = torch.Generator().manual_seed(seed + 10)
    weight = (torch.randn(C, K, generator=g) / 2).bfloat16().to(device)
    residual = torch.randn(x.shape, generator=g).bfloat16().to(device)
    args = (x, residual, conv, b["qsl"], b["slot_ids"], b["has_initial_state"], b["num_accepted"], weight, DILATION)
    want = short_conv_reference(*args)
    before = conv.clone()
    _assert_close(short_conv(*args), want)
    assert torch.equal(conv, before)  # the conv reads the windows, the store writes them


@pytest.mark.cpu_only
def test_the_tolerance_sees_a_window_read_from_the_wrong_offset():
    """The conv of a speculative batch with the accepted counts dropped (every window read from offset 0) falls
    outside the tolerance: the windows' entries matter to it."""
    b, conv, _, x, _ = _batch(0, True, "cpu")
    weight = (torch.randn(C, K, generator=torch.Generator().manual_seed(3)) / 2).bfloat16()
    args = (b["qsl"], b["slot_ids"], b["has_initial_state"])
    want = short_conv_reference(x, torch.zeros_like(x), conv, *args, b["num_accepted"], weight, DILATION)
    with pytest.raises(AssertionError):
        _assert_close(short_conv(x, torch.zeros_like(x), conv, *args, None, weight, DILATION), want)


@pytest.mark.cpu_only
def test_empty_batches_change_nothing():
    b, conv, ngram, x, ids = _batch(0, False, "cpu")
    empty = dict(qsl=torch.zeros(1, dtype=torch.int32), slot_ids=torch.empty(0, dtype=torch.int64),
                 has_initial_state=torch.empty(0, dtype=torch.bool))  # fmt: skip
    args = (empty["qsl"], empty["slot_ids"], empty["has_initial_state"], None)
    for store, conv_of in ((store_window, short_conv), (store_window_reference, short_conv_reference)):
        assert torch.equal(store(conv.clone(), x[:0], *args, None, L, 0), conv)
        assert conv_of(x[:0], x[:0], conv, *args, torch.ones(C, K).bfloat16(), DILATION).shape == (0, C)
