"""The hyper-connection kernels (`kernels.hyper_connection`, `kernels.down_silu`) against their torch references,
op by op (on the CPU under Triton's interpreter, and on a GPU) and as the loaded tiny checkpoint's `GatedResidual` runs
them.
float32 results agree to float32 rounding. bf16 ones to two bf16 steps of the tensor's largest value: the
interpreter casts float -> bf16 by truncation where a GPU rounds to nearest, and the kernels round where the
references do, so their bf16 results differ by a rounding step at a time."""

import functools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from benchmarks import bench_hyper_connection as bench_hc
from qwen4_exp_hcu.kernels import down_silu as ds
from qwen4_exp_hcu.kernels import hyper_connection as hc

DTYPES = [torch.float32, torch.bfloat16]
DEVICES = [pytest.param("cpu", marks=pytest.mark.cpu_only), pytest.param("cuda", marks=pytest.mark.gpu)]
cpu_only = pytest.mark.cpu_only  # the interpreter runs the kernels on CPU tensors only where no GPU is
T, HC, H = 5, 4, 48


def _randn(*shape, dtype, seed, scale=1.0, device="cpu"):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


def _assert_close(got, want):
    if want.dtype == torch.bfloat16:
        step = 2.0**-7 * want.abs().max().item()  # one bf16 step at the largest value
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=2 * step)
    else:
        torch.testing.assert_close(got, want)


def _assert_all_close(got: tuple, want: tuple):
    """Output by output; an output the reference leaves out (None) the kernel leaves out too."""
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            _assert_close(g, w)


def _pending(dtype, device):
    block_out = _randn(T, H, dtype=dtype, seed=1, device=device)
    return block_out, _randn(T, HC, dtype=dtype, seed=2, device=device).sigmoid() * 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("injected", [False, True])
@pytest.mark.parametrize("normed", [False, True])
def test_inject_norm_matches_reference(device, dtype, injected, normed):
    x = _randn(T, HC * H, dtype=dtype, seed=0, device=device)
    weight = _randn(HC * H, dtype=dtype, seed=3, scale=0.1, device=device)
    args = (x, weight if normed else None, 1e-6, H, *(_pending(dtype, device) if injected else ()))
    _assert_all_close(hc.inject_norm(*args), hc.inject_norm_reference(*args))


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tolerance_sees_streams_injected_with_each_others_weights(dtype):
    x, (block_out, weights) = _randn(T, HC * H, dtype=dtype, seed=0), _pending(dtype, "cpu")
    streams, _ = hc.inject_norm(x, None, 1e-6, H, block_out, weights)
    with pytest.raises(AssertionError):
        _assert_close(streams, hc.inject_norm_reference(x, None, 1e-6, H, block_out, weights.flip(-1))[0])


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tolerance_sees_a_norm_weight_without_its_offset(dtype):
    """The norm scales by `1 + w`: scaling by `w` (w ~ 0.1) must fail."""
    x, weight = _randn(T, HC * H, dtype=dtype, seed=0), _randn(HC * H, dtype=dtype, seed=3, scale=0.1)
    with pytest.raises(AssertionError):
        _assert_close(hc.inject_norm(x, weight, 1e-6, H)[1], hc.inject_norm_reference(x, weight - 1, 1e-6, H)[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_norm_of_a_single_group_matches_reference(device, dtype):
    """The MTP head normalises all hc * hidden values as one group."""
    x = _randn(3, HC * H, dtype=dtype, seed=4, device=device)
    weight = _randn(HC * H, dtype=dtype, seed=5, scale=0.1, device=device)
    _assert_close(hc.inject_norm(x, weight, 1e-6, HC * H)[1], hc.inject_norm_reference(x, weight, 1e-6, HC * H)[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_silu_matches_reference(device, dtype):
    """Read in place from a column slice, as from the merged down + injection GEMM's output."""
    x = _randn(T, 24, dtype=dtype, seed=6, scale=3.0, device=device)[:, :20]
    _assert_close(hc.scaled_silu(x, 4.0), hc.scaled_silu_reference(x, 4.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_logits", [False, True])
@pytest.mark.parametrize("block", [16, 1024, None])  # several column blocks per row, one, the default
def test_gate_mix_matches_reference(device, dtype, with_logits, block):
    up, normed = (_randn(T, HC * H, dtype=dtype, seed=seed, device=device) for seed in (7, 8))
    logits = _randn(T, 20 + HC, dtype=dtype, seed=9, scale=4.0, device=device)[:, 20:] if with_logits else None
    _assert_all_close(hc.gate_mix(up, normed, HC, logits, block=block), hc.gate_mix_reference(up, normed, HC, logits))


def _down_silu_inputs(t, dtype, device, n=40, k=600):
    """A merged weight of n rows (not a multiple of the kernel's 16 columns) over k inputs (not of its K block)."""
    x = _randn(t, k, dtype=dtype, seed=t, device=device)
    return x, _randn(n, k, dtype=dtype, seed=100 + t, scale=0.05, device=device), torch.zeros(64, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 17, ds.DOWN_SILU_MAX_TOKENS])  # whole rows up to 4 rows, dots above
def test_down_silu_matches_reference(device, dtype, tokens):
    """Column slices as the model takes them; the tile counters end at zero (the next launch's start), and a
    second launch gives the same bits (the K splits are added in a fixed order)."""
    x, weight, counts = _down_silu_inputs(tokens, dtype, device)
    got = ds.down_silu(x, weight, 30, 4.0, counts)
    _assert_all_close(got, ds.down_silu_reference(x, weight, 30, 4.0))
    assert not counts.any()
    assert all(map(torch.equal, ds.down_silu(x, weight, 30, 4.0, counts), got))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "tokens, config",
    [pytest.param(t, ds.DownSiluConfig(split=32, block_k=64, whole_rows=False), id=f"{t}-32_splits_most_idle") for t in (1, 17)]
    + [pytest.param(t, ds.DownSiluConfig(split=3, block_n=32, num_warps=8, whole_rows=False), id=f"{t}-3_splits_wide_columns") for t in (1, 17)]
    + [pytest.param(1, ds.DownSiluConfig(split=1, block_n=4, block_k=1024, whole_rows=False), id="1-one_split")]
    + [pytest.param(1, ds.DownSiluConfig(split=10, block_n=2, block_k=512, num_warps=2, whole_rows=False), id="1-two_columns_two_warps")]
    + [pytest.param(1, ds.DownSiluConfig(split=1, block_n=1, block_k=1024, whole_rows=False), id="1-a_column_per_program")]
    + [pytest.param(17, ds.DownSiluConfig(split=1), id="17-no_split")]
    + [pytest.param(t, ds.DownSiluConfig(whole_rows=True, block_n=n), id=f"{t}-whole_rows_{n}_columns") for t, n in ((1, 1), (3, 2), (4, 4), (17, 2))]
    + [pytest.param(17, ds.DownSiluConfig(split=10, block_n=16, block_k=1024, whole_rows=False), id="17-one_k_block_a_split")]
    + [pytest.param(17, ds.DownSiluConfig(split=3, block_k=64, warm_counter=True, whole_rows=False), id="17-counters_touched_early")],
)  # fmt: skip
def test_down_silu_launch_configs_agree(device, tokens, config):
    """The launches the benchmark sweeps match the reference too: more splits than K blocks (idle splits add
    zero partials), fewer splits with wider tiles, one K block a split wider than all of K (`tl.dot` over 1 024:
    the first split masked past K = 600, nine with nothing to add), the counters touched early (an add of 0: the count
    and its reset unchanged), (one token: no `tl.dot`) narrow blocks reading whole rows, and whole rows for more rows
    than a program holds (17 tokens: 5 programs a column, the last with one row)."""
    x, weight, counts = _down_silu_inputs(tokens, torch.bfloat16, device)
    got = ds.down_silu(x, weight, 30, 4.0, counts, config)
    _assert_all_close(got, ds.down_silu_reference(x, weight, 30, 4.0))
    assert not counts.any()


@cpu_only
@settings(max_examples=30, deadline=None)
@given(
    tokens=st.sampled_from([1, 2, 5, 17]),
    n=st.integers(31, 70),  # rank 30: at least one column past it
    k=st.integers(1, 300),
    split=st.sampled_from([1, 2, 3, 7]),
    block_n=st.sampled_from([1, 2, 4, 16, 32]),
    block_k=st.sampled_from([16, 64, 256]),
    whole_rows=st.booleans(),
)
def test_down_silu_any_launch_matches_reference(tokens, n, k, split, block_n, block_k, whole_rows):
    """Every launch the sweep could pick, on shapes no block divides: K spans ending mid-block, splits with nothing
    to add, a program per column, whole rows of any K (with a masked tail, none at a power of two); the counters
    end at zero."""
    assume(whole_rows or tokens == 1 or block_n >= 16)
    x = _randn(tokens, k, dtype=torch.float32, seed=k)
    weight = _randn(n, k, dtype=torch.float32, seed=n, scale=0.05)
    counts = torch.zeros(ds.DOWN_SILU_TILES, dtype=torch.int32)
    config = ds.DownSiluConfig(split=split, block_n=block_n, block_k=block_k, whole_rows=whole_rows)
    _assert_all_close(ds.down_silu(x, weight, 30, 4.0, counts, config), ds.down_silu_reference(x, weight, 30, 4.0))
    assert not counts.any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 5])  # whole rows, split-K dots
def test_down_silu_reads_rows_at_any_stride(device, tokens):
    """ROCm's vLLM pads a weight's rows against cache aliasing; the inputs may be a slice of a wider tensor."""
    x, weight, counts = _down_silu_inputs(tokens, torch.bfloat16, device)
    wide_x, wide_w = torch.zeros(tokens, 700, dtype=x.dtype, device=device), torch.zeros(40, 664, dtype=x.dtype, device=device)
    wide_x[:, :600], wide_w[:, :600] = x, weight
    got = ds.down_silu(wide_x[:, :600], wide_w[:, :600], 30, 4.0, counts)
    _assert_all_close(got, ds.down_silu_reference(x, weight, 30, 4.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [512, 1, 3])  # a power of two (no tail), the smallest K, a tail wider than the rest
def test_whole_rows_of_any_width(device, k):
    x, weight, counts = _down_silu_inputs(2, torch.bfloat16, device, k=k)
    got = ds.down_silu(x, weight, 30, 4.0, counts, ds.DownSiluConfig(whole_rows=True))
    _assert_all_close(got, ds.down_silu_reference(x, weight, 30, 4.0))


@cpu_only
@pytest.mark.parametrize("tokens, whole_rows", [(1, False), (17, False), (1, None)])  # None: whole rows up to 4 rows
def test_the_tolerance_sees_the_silu_on_the_wrong_columns(tokens, whole_rows):
    """The injection logits pass through unchanged: a silu over one more column must fail."""
    x, weight, counts = _down_silu_inputs(tokens, torch.bfloat16, "cpu")
    down, rest = ds.down_silu(x, weight, 31, 4.0, counts, ds.DownSiluConfig(whole_rows=whole_rows))
    with pytest.raises(AssertionError):
        _assert_all_close((down[:, :30], torch.cat((down[:, 30:], rest), -1)), ds.down_silu_reference(x, weight, 30, 4.0))


@cpu_only
def test_down_silu_refuses_what_it_does_not_serve():
    x, weight, counts = _down_silu_inputs(ds.DOWN_SILU_MAX_TOKENS + 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match=f"{ds.DOWN_SILU_MAX_TOKENS + 1} rows"):
        ds.down_silu(x, weight, 30, 4.0, counts)
    with pytest.raises(ValueError, match="tile counters"):
        ds.down_silu(x[:5], weight, 30, 4.0, counts[:2])
    with pytest.raises(ValueError, match="blocks of 16 columns"):
        ds.down_silu(x[:5], weight, 30, 4.0, counts, ds.DownSiluConfig(block_n=4))


@cpu_only
@pytest.mark.parametrize("tokens", bench_hc.SWEEP_TOKENS)
def test_every_sweep_label_names_its_launch(tokens):
    """`QWEN4_EXP_HCU_DOWN_SILU` serves a sweep's launch by its label: each reads back as the same config."""
    for config in bench_hc.sweep_configs(tokens):
        assert ds.DownSiluConfig.parse(config.label()) == config


@cpu_only
def test_a_launch_off_the_reference_cannot_win_the_sweep():
    """The sweep checks each launch's output once before timing it: one a bf16 step per value off stays in; a few
    steps off is reported under `failed` and is not the best, however fast."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, bench_hc.HC * bench_hc.HIDDEN, generator=g).to(torch.bfloat16)
    w = (torch.randn(bench_hc.RANK + bench_hc.HC, bench_hc.HC * bench_hc.HIDDEN, generator=g) / 100).to(torch.bfloat16)
    silu, rest = ds.down_silu_reference(x, w, bench_hc.RANK, float(bench_hc.HC))
    assert bench_hc.off_reference((silu, rest), x, w) is None
    step = (rest.float() * (1 + torch.finfo(torch.bfloat16).eps)).to(torch.bfloat16)  # one bf16 step at most
    assert bench_hc.off_reference((silu, step), x, w) is None
    off = (rest.float() * 1.05).to(torch.bfloat16)
    assert bench_hc.off_reference((silu, off), x, w).startswith("rest")
    fast_wrong, slow_right = ds.DownSiluConfig(split=16), ds.DownSiluConfig(split=10)
    timings = {fast_wrong: 1.0, slow_right: 2.0}
    row = bench_hc.config_row(
        lambda f: timings.get(f(None, None), 3.0), ("base", lambda w, counts: None), [fast_wrong, slow_right],
        lambda c: f"split{c.split}", lambda w, counts, c: c, lambda c: "silu off" if c is fast_wrong else None,
    )  # fmt: skip
    assert row["best"] == "split10" and "split16" in row["failed"] and "split16" not in row


@cpu_only
def test_the_block_sweep_takes_the_alone_sweeps_fastest():
    """The in-block sweep times the default and the alone sweep's fastest launches, by label; not the baseline,
    the failures or the summary fields."""
    alone = {"cublas_silu": 1.0, "split10_n16_k128_w4": 7.0, "rows_n1_w4": 13.0, "split8_n16_k256_w4": 7.5,
             "best": "split10_n16_k128_w4", "best_vs_cublas_silu": 0.1, "failed": {"split40_n16_k512_w4": "x"}}  # fmt: skip
    split_k = functools.partial(ds.DownSiluConfig, block_n=16, num_warps=4, warm_counter=False, whole_rows=False)
    assert bench_hc.block_candidates(alone, 2) == {
        "default": ds.DownSiluConfig(),
        "split10_n16_k128_w4": split_k(split=10, block_k=128),  # a label without `_wc`: counters touched after the wait
        "split8_n16_k256_w4": split_k(split=8, block_k=256),
    }


@cpu_only
def test_the_served_launch_comes_from_the_environment(monkeypatch):
    ds.configured_launch.cache_clear()
    monkeypatch.setenv("QWEN4_EXP_HCU_DOWN_SILU", "rows_n1_w8")
    assert ds.configured_launch() == ds.DownSiluConfig(whole_rows=True, block_n=1, num_warps=8)
    for label in ("rows_n1", "split10_n4_k1024_w2"):  # not a label; a one-token launch, which tl.dot refuses above
        ds.configured_launch.cache_clear()
        monkeypatch.setenv("QWEN4_EXP_HCU_DOWN_SILU", label)
        with pytest.raises(ValueError, match=f"QWEN4_EXP_HCU_DOWN_SILU='{label}'"):
            ds.configured_launch()
    ds.configured_launch.cache_clear()
    monkeypatch.delenv("QWEN4_EXP_HCU_DOWN_SILU")
    assert ds.configured_launch() == ds.DownSiluConfig()
    ds.configured_launch.cache_clear()


@cpu_only
def test_empty_batches_launch_nothing():
    x = torch.empty(0, HC * H)
    assert hc.inject_norm(x, torch.zeros(HC * H), 1e-6, H)[1].shape == x.shape
    assert hc.gate_mix(x, x, HC, torch.empty(0, HC))[0].shape == (0, H)
    assert hc.scaled_silu(torch.empty(0, 8), 4.0).shape == (0, 8)


def test_dependent_launch_only_where_the_gpu_has_it(monkeypatch):
    """Programmatic dependent launch (`griddepcontrol`, NVIDIA from Hopper): never for CPU tensors (the interpreter
    has no such instruction), nor on a GPU without it, nor with QWEN4_EXP_HCU_PDL=0."""
    on_gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert not hc.launch_pdl(torch.zeros(1))
    monkeypatch.setattr(hc, "_has_pdl", lambda device: False)
    assert not hc.launch_pdl(on_gpu)
    monkeypatch.setattr(hc, "_has_pdl", lambda device: True)
    assert hc.launch_pdl(on_gpu)
    monkeypatch.setenv("QWEN4_EXP_HCU_PDL", "0")
    assert not hc.launch_pdl(on_gpu)


def test_no_dependent_launch_without_the_instructions(monkeypatch):
    """A Triton without `griddepcontrol` (before 3.4) or a ROCm build launches as before, whatever the GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert hc._has_pdl.__wrapped__("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not hc._has_pdl.__wrapped__("cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delattr(hc.tl.extra.cuda, "gdc_wait")
    assert not hc._has_pdl.__wrapped__("cuda")


def _decode_chain(streams, pending, norm_w, down_w, up_w, counts, ops):
    """Two hyper-connections' kernels back to back at one token, as a decode step's graph launches them (each
    kernel reads what the one before it wrote): `ops` the kernels or their references."""
    inject_norm, down_silu, gate_mix = ops
    streams, normed = inject_norm(streams, norm_w, 1e-6, H, *pending)
    silu, rest = down_silu(normed, down_w, 30, float(HC))
    mixed, weights = gate_mix(torch.nn.functional.linear(silu, up_w), normed, HC, rest[:, :HC])
    streams, normed = inject_norm(streams, norm_w, 1e-6, H, mixed, weights)
    silu, rest = down_silu(normed, down_w, 30, float(HC))
    return gate_mix(torch.nn.functional.linear(silu, up_w), normed, HC, rest[:, :HC])


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_a_decode_chain_in_a_cuda_graph_matches_its_reference(monkeypatch, pdl):
    """The kernels captured in one CUDA graph, launched as programmatic dependents where the GPU has them: each
    replay, on new inputs, matches the references, and gives the bits the same kernels give launched one by one
    (a kernel that read its input before the one before it had written it would differ)."""
    monkeypatch.setenv("QWEN4_EXP_HCU_PDL", pdl)
    dev, dt = "cuda", torch.bfloat16
    streams = _randn(1, HC * H, dtype=dt, seed=0, device=dev)
    pending = _pending(dt, dev)[0][:1], _pending(dt, dev)[1][:1]
    norm_w = _randn(HC * H, dtype=dt, seed=3, scale=0.1, device=dev)
    down_w, up_w = _randn(40, HC * H, dtype=dt, seed=4, scale=0.05, device=dev), _randn(HC * H, 30, dtype=dt, seed=5, scale=0.2, device=dev)
    counts = torch.zeros(ds.DOWN_SILU_TILES, dtype=torch.int32, device=dev)
    kernels = (hc.inject_norm, lambda *a: ds.down_silu(*a, counts), hc.gate_mix)
    references = (hc.inject_norm_reference, ds.down_silu_reference, hc.gate_mix_reference)
    args = (streams, pending, norm_w, down_w, up_w, counts)
    _decode_chain(*args, kernels)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_chain(*args, kernels)
    for seed in range(5):
        streams.copy_(_randn(1, HC * H, dtype=dt, seed=10 + seed, device=dev))
        graph.replay()
        for got, want in zip(out, _decode_chain(*args, references), strict=True):
            torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
        assert all(map(torch.equal, out, _decode_chain(*args, kernels)))


@pytest.fixture(scope="module")
def tiny_model(vllm_process, tiny):
    """The tiny BF16 checkpoint's model, loaded in the test process, with vLLM's CPU GEMMs picked."""
    from vllm.model_executor.layers.linear import LinearBase

    from helpers.vllm_inproc import load

    model = load(tiny["bf16"], dtype="bfloat16")
    for linear in (m for m in model.modules() if isinstance(m, LinearBase)):
        linear.quant_method.process_weights_after_loading(linear)
    return model


def _inputs(config):
    streams = _randn(T, config.hc_count * config.hidden_size, dtype=torch.bfloat16, seed=10)
    return streams, _randn(T, config.hidden_size, dtype=torch.bfloat16, seed=11)


@cpu_only
@pytest.mark.vllm
def test_gated_residual_runs_the_kernels_as_its_reference(tiny_model, monkeypatch):
    """The tiny checkpoint's hyper-connections (a decoder layer's two, fused injection included, and the final
    mixer) with the kernels forced on the CPU give what they give with the references the CPU serves with."""
    import qwen4_exp_hcu.model.hyper_connection as module

    layer, mixer = tiny_model.model.layers[0], tiny_model.model.hyper_connection_mixer
    streams, block_out = _inputs(tiny_model.config)

    def run():
        attn_streams, x, weights = layer.attn_hyper_connection(streams)
        mlp_streams, x, weights = layer.mlp_hyper_connection(attn_streams, (x + block_out, weights))
        return attn_streams, mlp_streams, x, weights, module.inject(mlp_streams, block_out, weights), mixer(mlp_streams)

    expected = run()
    monkeypatch.setattr(module, "dispatch", lambda launcher, reference, *args, **kwargs: launcher(*args, **kwargs))
    _assert_all_close(run(), expected)


@cpu_only
@pytest.mark.vllm
@pytest.mark.parametrize("tokens", [1, 5])  # multiply-adds, dots
def test_gated_residual_fused_at_decode_sizes_as_unfused(vllm_process, tiny, monkeypatch, tokens):
    """The model's decode path on an accelerator (the down GEMM with its silu in one launch) gives what its GEMM-library path gives, on the checkpoint's own weights: a decoder layer's
    hyper-connection with a pending injection and the final mixer. Run on the CPU with the fusion forced and the
    kernels under the interpreter, on the weights as loaded (vLLM's CPU GEMMs repack them; torch's GEMM here, as
    an accelerator's unquantized linears run)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    import qwen4_exp_hcu.model.hyper_connection as module
    from helpers.vllm_inproc import load

    model = load(tiny["bf16"], dtype="bfloat16")
    monkeypatch.setattr(UnquantizedLinearMethod, "apply", lambda self, layer, x, bias=None: torch.nn.functional.linear(x, layer.weight, bias))
    layer, mixer = model.model.layers[0], model.model.hyper_connection_mixer
    streams, block_out = (x[:tokens] for x in _inputs(model.config))
    weights = _randn(tokens, model.config.hc_count, dtype=torch.bfloat16, seed=12).sigmoid() * 2

    def run():
        return (*layer.mlp_hyper_connection(streams, (block_out, weights)), mixer(streams))

    monkeypatch.setattr(module, "dispatch", lambda launcher, reference, *args, **kwargs: launcher(*args, **kwargs))
    unfused = run()
    calls = []
    kernel = module.down_silu
    monkeypatch.setattr(module, "down_silu", lambda x, w, *a, **kw: calls.append(w.shape[0]) or kernel(x, w, *a, **kw))
    monkeypatch.setattr(module.GatedResidual, "_fuse_down", staticmethod(lambda normed: True))
    _assert_all_close(run(), unfused)
    # the layer's hyper-connection, then the mixer; neither reads the weight's padding rows (the release: 324 of 336)
    assert calls == [sum(layer.mlp_hyper_connection.sizes), sum(mixer.sizes)]


# `aten.t`: vLLM's CPU linear is `F.linear` (a transposed view + `mm`) where the CPU lacks AVX-512, one oneDNN op where
# it has it; either way one GEMM a projection.
ALLOCATIONS_AND_VIEWS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
                         "aten.view.default", "aten.split_with_sizes.default", "aten.slice.Tensor", "aten.t.default"}  # fmt: skip


@cpu_only
@pytest.mark.vllm
def test_a_hyper_connection_is_two_gemms_and_three_launches(tiny_model, monkeypatch):
    """What makes the kernels pay: with a pending injection, a hyper-connection runs its two GEMMs (the merged
    down + injection one, the up one) and launches each kernel once, and no other torch op computes or copies
    (the GEMM's column slices are read in place). Launches are recorded, not run."""
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode

    import qwen4_exp_hcu.model.hyper_connection as module

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    launches = []
    for name in ("_inject_norm_kernel", "_scaled_silu_kernel", "_gate_mix_kernel"):
        recorder = mock.MagicMock()
        recorder.__getitem__.return_value = lambda *args, name=name, **kwargs: launches.append(name)
        monkeypatch.setattr(hc, name, recorder)
    monkeypatch.setattr(module, "dispatch", lambda launcher, reference, *args, **kwargs: launcher(*args, **kwargs))
    streams, block_out = _inputs(tiny_model.config)
    weights = torch.rand(T, tiny_model.config.hc_count).bfloat16()
    with Ops() as ops:
        tiny_model.model.layers[0].mlp_hyper_connection(streams, (block_out, weights))
    assert launches == ["_inject_norm_kernel", "_scaled_silu_kernel", "_gate_mix_kernel"]
    assert len([name for name in ops.names if name not in ALLOCATIONS_AND_VIEWS]) == 2, ops.names


@cpu_only
@pytest.mark.vllm
def test_the_merged_gemm_writes_aligned_rows(tiny_model):
    """The down + injection GEMM's output rows are padded to 16 columns (the release's 320 + 4 bf16 columns made
    cuBLAS take align-2 kernels); the padding's weight rows are zeros, and the mixer, which has no injection,
    gets no logits from the padding."""
    layer, mixer = tiny_model.model.layers[0], tiny_model.model.hyper_connection_mixer
    for residual in (layer.attn_hyper_connection, layer.mlp_hyper_connection, mixer):
        linear = residual.input_mix_weight_down_block_inject
        assert sum(linear.output_sizes) % 16 == 0 and linear.output_sizes[: len(residual.sizes)] == residual.sizes
        assert not linear.weight[sum(residual.sizes) :].any()
    streams, _ = _inputs(tiny_model.config)
    assert mixer(streams).shape == (T, tiny_model.config.hidden_size)


@pytest.mark.vllm
def test_the_model_fuses_the_down_gemm_at_decode_sizes_on_an_accelerator(monkeypatch):
    """Which batches take `down_silu`: 1..FUSED_DOWN_MAX_TOKENS tokens on a CUDA-alike device, eager or in a
    CUDA graph; never on the CPU, under torch.compile, in vLLM's batch-invariant mode or where
    `QWEN4_EXP_HCU_TORCH_OPS` names it."""
    from types import SimpleNamespace

    from vllm import envs

    from qwen4_exp_hcu.model.hyper_connection import FUSED_DOWN_MAX_TOKENS, GatedResidual

    def fused(tokens, device="cuda"):
        return GatedResidual._fuse_down(SimpleNamespace(device=torch.device(device), shape=(tokens, 8)))

    assert FUSED_DOWN_MAX_TOKENS <= ds.DOWN_SILU_MAX_TOKENS
    assert [fused(t) for t in (0, 1, FUSED_DOWN_MAX_TOKENS, FUSED_DOWN_MAX_TOKENS + 1)] == [False, True, True, False]
    assert not fused(1, "cpu")
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True)
    assert not fused(1)
    monkeypatch.undo()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not fused(1)
    monkeypatch.undo()
    monkeypatch.setenv("QWEN4_EXP_HCU_TORCH_OPS", "down_silu")
    assert not fused(1)
