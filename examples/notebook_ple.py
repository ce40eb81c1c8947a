"""Standalone PLE (no vLLM): a layer from a checkpoint, host-offloaded INT8 table, prefetch, forward.

    python -m qwen4_exp_hcu.tiny /tmp/qwen4-tiny-int8 --int8      # or any Qwen4Exp checkpoint
    python examples/notebook_ple.py /tmp/qwen4-tiny-int8
"""

import sys

import torch

from qwen4_exp_hcu.ple.batch import PLEBatch, PLEState
from qwen4_exp_hcu.ple.checkpoint import load_ple_layer, text_config_of
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace
from qwen4_exp_hcu.ple.storage import PLEStorage

ckpt = sys.argv[1] if len(sys.argv) > 1 else "/tmp/qwen4-tiny-int8"
device = "cuda" if torch.cuda.is_available() else "cpu"
cfg = text_config_of(ckpt)
layer = load_ple_layer(ckpt, cfg.ple_layer_ids[0], PLEStorage(device=device, host=True), dtype=torch.bfloat16)
print("table:", layer.table.describe())

# one step: two requests packed in one batch (5 and 3 tokens), each owning a state slot; both are new
ids = torch.tensor([5, 6, cfg.eos_token_id, 8, 9, 10, 11, 12], device=device)
batch = PLEBatch.from_lengths(ids, [5, 3], slot_ids=[0, 1], has_initial_state=[False, False])
state = PLEState.zeros(layer.state_shapes(), slots=4, dtype=torch.bfloat16, device=device)  # n-gram context + conv window
streams = torch.randn(len(ids), cfg.hc_count * cfg.hidden_size, dtype=torch.bfloat16, device=device)

prefetch = PrefetchWorkspace([layer], max_tokens=64, device=device).handles[0]
prefetch.start(batch, state)  # issue this before the preceding decoder layer
out = layer(streams, batch, state, embeddings=prefetch.wait())
print("PLE output:", tuple(out.shape), out.dtype, "| n-gram context now:", state.ngram[:2].tolist())
