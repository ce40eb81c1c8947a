"""Where a file-tier engine departs from a whole-table one (a diagnosis, not a test). Serves `PROMPTS` through
engines in turn (`whole`: no file tier; `all`: a budget holding every row; or settings as JSON) with the suite's
settings (on a GPU: `FULL_DECODE_ONLY`). In each, every eager lookup's ids and output are kept (on its stream,
after its kernel) with its step's layout, and what each layer received from the prefetch join. After serving it
prints the lookups that differ from the whole table's lookup of the same ids, the joins that differ from their
lookup, each engine's eager steps (tokens, `query_start_loc`), and how far each engine's logprobs are from the
earlier ones'.

    python tools/diagnose_file_tier.py whole all whole      # on a GPU, the core in its own process: VLLM_ENABLE_V1_MULTIPROCESSING=1

On the CPU add VLLM_DISABLE_COMPILE_CACHE=1: there an engine that compiles the model and one that loads vLLM's cached
compilation differ in bf16 (0.016-0.045 here, every lookup exact), whatever their tables.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # as the suite runs (conftest): Triton kernels through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_vllm_file_tier import SERIALIZE, _differences, generate, ple_blocks, start_engine  # noqa: E402

from qwen4_exp_hcu.names import ple_layers  # noqa: E402
from qwen4_exp_hcu.ple.checkpoint import load_ple_layer, text_config_of  # noqa: E402
from qwen4_exp_hcu.ple.storage import PLEStorage  # noqa: E402
from qwen4_exp_hcu.tiny import make_tiny_int8_checkpoint  # noqa: E402


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def install(model) -> None:
    """Wrap every PLE layer's lookup, table lookup and prefetch join to keep what they returned (eager steps only:
    a graph replay runs no Python)."""
    records = model._diagnosis = []
    for block in ple_blocks(model):
        layer, table, prefetch, name = block.layer, block.layer.table, block.prefetch, block.prefix

        def layer_lookup(batch, state, out=None, _orig=layer.lookup, _name=name):
            res = _orig(batch, state, out=out)
            if not _capturing():
                records.append(("step", _name, batch.input_ids.shape[0], batch.query_start_loc.clone(), None))
            return res

        def table_lookup(ids, out=None, _orig=table.lookup, _name=name):
            res = _orig(ids, out=out)
            if not _capturing():
                records.append(("lookup", _name, ids.clone(), None, res.clone()))
            return res

        layer.lookup, table.lookup = layer_lookup, table_lookup
        if prefetch is not None:

            def wait(_orig=prefetch.wait, _name=name):
                res = _orig()
                if not _capturing():
                    records.append(("join", _name, None, None, res.clone()))
                return res

            prefetch.wait = wait


def check(path: str):
    def run(model) -> list[str]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        blocks = ple_blocks(model)
        wholes = {b.prefix: load_ple_layer(path, i.layer_id, PLEStorage(host=True)).table
                  for b, i in zip(blocks, ple_layers(text_config_of(path)))}  # fmt: skip
        lines, last, steps = [], {}, []
        for n, (kind, name, ids, qsl, res) in enumerate(model._diagnosis):
            if kind == "lookup":
                last[name] = res.cpu()
                bad = (last[name] != wholes[name].lookup(ids.cpu())).any(-1).nonzero().flatten().tolist()
                if bad:
                    lines.append(f"record {n}: {name}'s lookup of {ids.shape[0]} tokens differs from the whole table at tokens {bad[:20]}")
            elif kind == "join":
                if name not in last or not torch.equal(last[name], res.cpu()):
                    lines.append(f"record {n}: {name}'s join differs from its lookup")
            elif name == blocks[0].prefix:
                steps.append(f"{ids} tokens {qsl.tolist()}")
        return [f"{len(model._diagnosis)} records, {len(lines)} faults", *lines, f"eager steps: {'; '.join(steps)}"]

    return run


def serve(path, settings: dict):
    from helpers import engines

    llm = start_engine(path, settings, in_process=False)  # where the engine core runs: VLLM_ENABLE_V1_MULTIPROCESSING
    try:
        with engines.environment(SERIALIZE):
            llm.apply_model(install)
            runs = generate(llm)
            for line in llm.apply_model(check(str(path)))[0]:
                print("DIAGNOSIS", line, flush=True)
    finally:
        engines.stop(llm)
    return runs


def main() -> None:
    path = make_tiny_int8_checkpoint(Path(tempfile.mkdtemp()) / "int8")
    layers = [load_ple_layer(path, i.layer_id).table.nbytes for i in ple_layers(text_config_of(path))]
    named = {"whole": {}, "all": {"host_table_gib": len(layers) * max(layers) / 2**30}}
    runs = []
    for arg in sys.argv[1:] or ["whole", "all"]:
        print("DIAGNOSIS engine", arg, flush=True)
        runs.append((arg, serve(path, named[arg] if arg in named else json.loads(arg))))
        for name, earlier in runs[:-1]:
            print(f"DIAGNOSIS {arg} against {name}:", _differences(runs[-1][1], earlier), flush=True)


if __name__ == "__main__":
    main()
