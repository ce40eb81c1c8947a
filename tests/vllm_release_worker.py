"""Build our model class and load checkpoints through one vLLM release's own model loader, on the CPU: the
release-guard half of `test_vllm_releases.py`, run in a process whose `vllm` is that release (its Python
sources first on PYTHONPATH, `vllm_release_stand_ins` for what a source-only install lacks).

    PYTHONPATH=.dev/vllm-0.34.0 python tests/vllm_release_worker.py CHECKPOINTS OUT.json [CASE ...]

CHECKPOINTS holds the directories `CASES` names. Each case builds the engine config vLLM builds at start-up,
then `get_model_loader(...).load_model(...)`: our class built, every checkpoint tensor through its
`load_weights`, vLLM's check that every parameter was loaded, post-load processing. OUT.json gets, per case,
`loaded` (with the attention class and the PLE tables' storage) or the error's type and message.
"""

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_release_stand_ins  # noqa: E402

vllm_release_stand_ins.install()

import torch  # noqa: E402

MAX_MODEL_LEN = 256
LONG = 4096  # beyond the checkpoints' QSA budget (2048): vLLM's QSA attention serves the attention layers
CASES = {
    "bf16": ("bf16", {}),
    "int8": ("int8", {}),
    "release_bf16": ("release-bf16", {}),  # the BF16 release's layout: fused experts, multimodal names, MTP head
    "release_fp8": ("release-fp8", {}),  # the FP8 release's PLE table (one table scale), its experts in BF16
    "mtp": ("mtp", {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}),
    "long_context": ("int8", {"max_model_len": LONG, "hf_overrides": {"max_position_embeddings": LONG}}),
}


def initialize_distributed() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")  # fmt: skip
        ensure_model_parallel_initialized(1, 1)


def load(path: Path, **engine_args):
    """(target model, draft model or None) as a vLLM engine's worker loads them."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.model_loader import get_model_loader

    engine_args = {"max_model_len": MAX_MODEL_LEN, "dtype": "bfloat16", **engine_args}
    config = EngineArgs(model=str(path), max_num_batched_tokens=64, max_num_seqs=4, **engine_args).create_engine_config()
    loader = get_model_loader(config.load_config)
    try:
        with set_current_vllm_config(config):
            model = loader.load_model(vllm_config=config, model_config=config.model_config)
            draft = None
            if config.speculative_config is not None:
                draft_config = config.speculative_config.draft_model_config
                draft = loader.load_model(vllm_config=config, model_config=draft_config)
        return model, draft
    finally:  # rotary embeddings are cached process-wide
        rotary_embedding._ROPE_DICT.clear()


def run_case(path: Path, engine_args: dict, long_context: bool) -> dict:
    import qwen4_exp_hcu.model.model as ours

    refusal = ours.check_dense_attention_allowed
    if long_context:  # the CPU refuses to serve beyond the budget; here QSA layers are only built and loaded
        ours.check_dense_attention_allowed = lambda *args: None
    start = time.perf_counter()
    try:
        model, draft = load(path, **engine_args)
    except Exception as e:  # noqa: BLE001  (reported, judged by the test)
        innermost = traceback.extract_tb(e.__traceback__)[-1].filename
        return {"outcome": "error", "type": type(e).__name__, "message": str(e)[:2000], "raised_in": innermost,
                "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
    finally:
        ours.check_dense_attention_allowed = refusal
    text = getattr(model, "language_model", model)
    attention = [type(layer.self_attn).__name__ for layer in text.model.layers if hasattr(layer, "self_attn")]
    return {
        "outcome": "loaded",
        "seconds": round(time.perf_counter() - start, 2),
        "class": type(model).__name__,
        "attention": sorted(set(attention)),
        "ple_tables": [{k: t[k] for k in ("layer", "device", "dtype", "rows", "bytes")} for t in text.ple_table_reports()],
        "draft": None if draft is None else type(draft).__name__,
    }


def main(argv: list[str]) -> None:
    import vllm

    checkpoints, out, *names = argv
    initialize_distributed()
    from qwen4_exp_hcu.env import vision_available
    from qwen4_exp_hcu.model.vllm_api import has_qwen4_exp

    results = {"vllm": vllm.__version__, "torch": torch.__version__, "vision": vision_available(),
               "qwen4_exp": has_qwen4_exp(), "cases": {}}  # fmt: skip
    for name in names or CASES:
        directory, engine_args = CASES[name]
        results["cases"][name] = run_case(Path(checkpoints) / directory, engine_args, name == "long_context")
    Path(out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
