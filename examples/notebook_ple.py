"""Standalone PLE (no vLLM): a layer from a checkpoint, host-offloaded INT8 table, prefetch, forward.

    python -m qwen4_exp_hcu.tiny /tmp/qwen4-tiny-int8 --int8      # or any Qwen4Exp checkpoint
    python examples/notebook_ple.py /tmp/qwen4-tiny-int8
"""

import sys

import torch

from qwen4_exp_hcu.ple.checkpoint import load_ple_layer, text_config_of
from qwen4_exp_hcu.ple.prefetch import PrefetchWorkspace

ckpt = sys.argv[1] if len(sys.argv) > 1 else "/tmp/qwen4-tiny-int8"
device = "cuda" if torch.cuda.is_available() else "cpu"
cfg = text_config_of(ckpt)
layer = load_ple_layer(ckpt, cfg.ple_layer_ids[0], device=device, host_table=True, dtype=torch.bfloat16)
print("table:", layer.table.describe())

# two requests packed in one batch; each owns a state slot (n-gram context + short-conv window)
ids = torch.tensor([5, 6, cfg.eos_token_id, 8, 9, 10, 11, 12], device=device)
qsl = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
slots = torch.tensor([0, 1], device=device)
ctx_shape, conv_shape = layer.state_shapes()
ngram_state = torch.zeros(4, *ctx_shape, dtype=torch.int64, device=device)
conv_state = torch.zeros(4, *conv_shape, dtype=torch.bfloat16, device=device)
fresh = torch.tensor([False, False], device=device)
streams = torch.randn(len(ids), cfg.hc_count * cfg.hidden_size, dtype=torch.bfloat16, device=device)

workspace = PrefetchWorkspace([layer], max_tokens=64, device=device)
workspace.start(0, ids, qsl, slots, ngram_state, fresh)  # issue this before the preceding decoder layer
out = layer(streams, ids, qsl, slots, ngram_state, conv_state, fresh, embeddings=workspace.wait(0))
print("PLE output:", tuple(out.shape), out.dtype, "| n-gram context now:", ngram_state[:2].tolist())
