"""PrefetchWorkspace: same results as the plain forward, eagerly and inside a captured CUDA graph."""

import pytest
import torch

from helpers.configs import tiny_text_config
from helpers.layers import make_pair
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace


def empty_state(layer, slots, dtype=torch.float32, device="cpu"):
    return PLEState.zeros(layer.state_shapes(), slots, dtype, device)


def test_prefetched_forward_equals_plain_forward():
    cfg = tiny_text_config()
    _, l0 = make_pair(cfg, ple_index=0, quantized=True)
    _, l1 = make_pair(cfg, ple_index=1, quantized=True)
    ws = PrefetchWorkspace([l0, l1], max_tokens=16, device="cpu")
    C = cfg.hidden_size * cfg.hc_count
    plain = [empty_state(l, 3) for l in (l0, l1)]
    pre = [empty_state(l, 3) for l in (l0, l1)]
    for step, lens in enumerate([[5, 3], [1, 1], [1, 1]]):
        T = sum(lens)
        ids, hs = torch.randint(0, 97, (T,)), torch.randn(T, C)
        batch = PLEBatch.from_lengths(ids, lens, [2, 0], [step > 0] * 2)
        for i, layer in enumerate((l0, l1)):
            ws.handles[i].start(batch, pre[i])
            want = layer(hs, batch, plain[i])
            got = layer(hs, batch, pre[i], embeddings=ws.handles[i].wait())
            assert torch.equal(got, want)
            assert torch.equal(pre[i].ngram, plain[i].ngram) and torch.equal(pre[i].conv, plain[i].conv)


def test_capacity_and_pairing_errors():
    cfg = tiny_text_config()
    _, layer = make_pair(cfg)
    ws = PrefetchWorkspace([layer], max_tokens=4, device="cpu")
    batch = PLEBatch.from_lengths(torch.zeros(5, dtype=torch.int64), [5], [0], [False])
    with pytest.raises(ValueError, match="5 tokens exceed the workspace capacity max_tokens=4"):
        ws.handles[0].start(batch, empty_state(layer, 2))
    with pytest.raises(RuntimeError, match="without a start"):
        ws.handles[0].wait()


@pytest.mark.gpu
def test_gpu_prefetch_in_cuda_graph_replays_exactly():
    cfg = tiny_text_config()
    _, ref = make_pair(cfg, quantized=True)
    _, layer = make_pair(cfg, quantized=True, device="cuda", host=True)
    layer.to(torch.bfloat16), ref.to(torch.bfloat16)
    ws = PrefetchWorkspace([layer], max_tokens=32, device="cuda")
    C, T, B = cfg.hidden_size * cfg.hc_count, 24, 3
    ids = torch.zeros(T, dtype=torch.int64, device="cuda")
    hs = torch.zeros(T, C, dtype=torch.bfloat16, device="cuda")
    qsl = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    slots = torch.tensor([4, 0, 2], device="cuda")
    init = torch.zeros(B, dtype=torch.bool, device="cuda")
    batch = PLEBatch(ids, qsl, slots, init)  # wraps the static tensors the graph reads
    state = empty_state(layer, 6, dtype=torch.bfloat16, device="cuda")
    ref_state = empty_state(ref, 6, dtype=torch.bfloat16)
    prefetch = ws.handles[0]

    def step():
        prefetch.start(batch, state)
        hs.mul_(1.0)  # stands in for the preceding decoder layer on the main stream
        return layer(hs, batch, state, embeddings=prefetch.wait())

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream().wait_stream(warm)
    state.ngram.zero_(), state.conv.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator().manual_seed(0)
    for i, lens in enumerate([[10, 6, 8], [1, 1, 1], [3, 0, 2]]):
        n = sum(lens)
        new_ids, new_hs = torch.randint(0, 97, (T,), generator=g), torch.randn(T, C, generator=g).bfloat16()
        ref_batch = PLEBatch.from_lengths(new_ids, lens, slots.cpu(), [i > 0] * B)
        ids.copy_(new_ids), hs.copy_(new_hs), qsl.copy_(ref_batch.query_start_loc), init.fill_(i > 0)
        graph.replay()
        torch.cuda.synchronize()
        want = ref(new_hs, ref_batch, ref_state)
        torch.testing.assert_close(out[:n].cpu(), want[:n], atol=2e-2, rtol=2e-2)
        assert torch.equal(state.ngram.cpu(), ref_state.ngram)
