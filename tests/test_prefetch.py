"""PrefetchWorkspace: same results as the plain forward, eagerly and inside a captured CUDA graph."""

import pytest
import torch

from layer_utils import empty_state, make_pair
from ple_configs import tiny_text_config
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace


def qsl_of(lens, device="cpu"):
    return torch.tensor([0] + list(lens), device=device).cumsum(0).to(torch.int32)


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
        meta = (qsl_of(lens), torch.tensor([2, 0]))
        init = torch.tensor([step > 0] * 2)
        for i, layer in enumerate((l0, l1)):
            ws.start(i, ids, *meta, pre[i][0], init)
            want = layer(hs, ids, *meta, *plain[i], init)
            got = layer(hs, ids, *meta, *pre[i], init, embeddings=ws.wait(i))
            assert torch.equal(got, want)
            assert all(torch.equal(a, b) for a, b in zip(pre[i], plain[i]))


def test_capacity_and_pairing_errors():
    cfg = tiny_text_config()
    _, layer = make_pair(cfg)
    ws = PrefetchWorkspace([layer], max_tokens=4, device="cpu")
    ctx, _ = empty_state(layer, 2)
    with pytest.raises(ValueError, match="5 tokens exceed the workspace capacity max_tokens=4"):
        ws.start(0, torch.zeros(5, dtype=torch.int64), qsl_of([5]), torch.tensor([0]), ctx, torch.tensor([False]))
    with pytest.raises(RuntimeError, match="without a start"):
        ws.wait(0)


@pytest.mark.gpu
def test_gpu_prefetch_in_cuda_graph_replays_exactly():
    cfg = tiny_text_config()
    _, ref = make_pair(cfg, quantized=True)
    _, layer = make_pair(cfg, quantized=True, device="cuda", host_table=True)
    layer.to(torch.bfloat16), ref.to(torch.bfloat16)
    ws = PrefetchWorkspace([layer], max_tokens=32, device="cuda")
    C, T, B = cfg.hidden_size * cfg.hc_count, 24, 3
    ids = torch.zeros(T, dtype=torch.int64, device="cuda")
    hs = torch.zeros(T, C, dtype=torch.bfloat16, device="cuda")
    qsl = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    slots = torch.tensor([4, 0, 2], device="cuda")
    init = torch.zeros(B, dtype=torch.bool, device="cuda")
    state = empty_state(layer, 6, dtype=torch.bfloat16, device="cuda")
    ref_state = empty_state(ref, 6, dtype=torch.bfloat16)

    def step():
        ws.start(0, ids, qsl, slots, state[0], init)
        hs.mul_(1.0)  # stands in for the preceding decoder layer on the main stream
        return layer(hs, ids, qsl, slots, *state, init, embeddings=ws.wait(0))

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream().wait_stream(warm)
    for s in state:
        s.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator().manual_seed(0)
    for i, lens in enumerate([[10, 6, 8], [1, 1, 1], [3, 0, 2]]):
        n = sum(lens)
        new_ids, new_hs = torch.randint(0, 97, (T,), generator=g), torch.randn(T, C, generator=g).bfloat16()
        ids.copy_(new_ids), hs.copy_(new_hs), qsl.copy_(qsl_of(lens)), init.fill_(i > 0)
        graph.replay()
        torch.cuda.synchronize()
        want = ref(new_hs, new_ids, qsl_of(lens), slots.cpu(), *ref_state, init.cpu())
        torch.testing.assert_close(out[:n].cpu(), want[:n], atol=2e-2, rtol=2e-2)
        assert torch.equal(state[0].cpu(), ref_state[0])
