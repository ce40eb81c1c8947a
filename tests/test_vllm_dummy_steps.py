"""Steps without requests: vLLM's profile run (and a DP rank's padding step) carries no metadata for the PLE layers.
Each layer then runs on one padding request holding every token, so the profile run measures its activations
with the rest of the model's, and it leaves no state behind. Built in the test process (`vllm_process`)."""

import pytest
import torch

from helpers.vllm_inproc import engine_config, load
from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState

pytestmark = pytest.mark.vllm


def test_a_step_without_metadata_runs_the_ple_layer_on_padding(vllm_process, tiny):
    from vllm.forward_context import set_forward_context
    from vllm.platforms import current_platform

    device = torch.device(current_platform.device_type)  # where vLLM puts the prefetch workspace: the engine's device
    model = load(tiny["int8"], device=device, dtype="float32")
    block = model.model.ple_blocks[0]
    config = model.config
    T = 12
    ids = torch.randint(3, config.vocab_size, (T,), generator=torch.Generator().manual_seed(0)).to(device)
    streams = torch.randn(T, config.hc_count * config.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.full_like(streams, float("nan"))
    with set_forward_context(None, engine_config(tiny["int8"], dtype="float32")), torch.no_grad():
        if block.prefetch is not None:  # as the model starts it, before the previous layer
            block.run_prefetch(ids)
        block.run_forward(streams, ids, out)
    fresh = PLEState.zeros(block.layer.state_shapes(), 1, torch.float32, device)
    expected = block.layer(streams, PLEBatch.from_lengths(ids, [T], [-1], [False]), fresh)
    torch.testing.assert_close(out, expected)
    assert out.abs().sum() > 0  # the layer ran: not the zeros a skipped lookup leaves
    assert fresh.ngram.eq(0).all() and fresh.conv.eq(0).all()  # a padding request writes no state
