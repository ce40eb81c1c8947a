"""A transformers PLE layer with random weights and our PLELayer built from its checkpoint tensors."""

import torch
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer

from qwen4_exp_hcu.names import TABLE
from qwen4_exp_hcu.ple.int8 import dequantize_rows, quantize_rows
from qwen4_exp_hcu.ple.layer import PLELayer


def make_pair(cfg, ple_index=1, quantized=False, seed=0, **kw):
    """(transformers layer in fp32, our layer) holding the same weights. With `quantized` our layer
    gets INT8 shards and the transformers table holds their dequantized rows: the same function."""
    torch.manual_seed(seed)
    hf = Qwen4ExpTextPLELayer(cfg, cfg.ple_layer_ids[ple_index] - 1, ple_index).float()
    with torch.no_grad():
        for p in hf.parameters():
            torch.nn.init.normal_(p, std=0.3)
    sd = dict(hf.state_dict())
    table = sd.pop(f"{TABLE}.weight").to(torch.bfloat16)
    q, s = quantize_rows(table)
    if quantized:
        table = dequantize_rows(q, s)
    with torch.no_grad():
        hf.ple_embedding.ngram_embedding.weight.copy_(table.float())
    n = -(-table.shape[0] // cfg.split_ngram_parts)
    for j in range(cfg.split_ngram_parts):
        rows = slice(j * n, (j + 1) * n)
        name = f"{TABLE}.shard_{j}.weight"
        if quantized:
            sd[name], sd[name + "_scale"] = q[rows], s[rows]
        else:
            sd[name] = table[rows]
    ours = PLELayer.from_state_dict(cfg, ple_index, sd, table_format="int8" if quantized else "bf16", dtype=torch.float32, **kw)
    return hf, ours
