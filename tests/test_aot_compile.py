"""Every Triton kernel of the package compiles ahead of time for the GPUs we serve on (CDNA, Hopper, Ampere):
no accelerator needed, so a kernel change that only an AMD or an older NVIDIA compiler rejects fails here.

Each kernel is compiled with what its launcher really passes: the launcher runs on CPU stand-in tensors of
the dtypes the library gives it, with its kernel swapped for a recorder, so the signature (from the argument
dtypes), constexprs and num_warps come from the launcher itself and cannot drift from it. The variants are
the ones the library launches: every table format of `PLETable` with its device and host tuning, with and
without the hot-row cache; the n-gram hash of the tiny config and of the release geometry; the window store
for the n-gram context and, with the short conv, for every model dtype of the conv window; the hyper-connection
glue at the release's shape. Each compiles twice: as the JIT
specializes a launch with aligned tensors (the usual case: vectorized or AMD buffer loads), and with no
specialization (what misaligned arguments get).

The compiles run in spawned workers with the interpreter off: conftest turns it on for CPU runs, and under
it Triton's own library functions (`tl.zeros`, ...) are interpreter functions that no compiler takes.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import native_specialize_impl

from helpers.releases import census, text_config
from qwen4_exp_hcu.kernels import down_silu, gather_dequant, hyper_connection, ngram_hash, ple_gate, short_conv
from qwen4_exp_hcu.ple.hashing import NgramHashSpec
from qwen4_exp_hcu.ple.tiers.hot_rows import HotRows
from qwen4_exp_hcu.ple.storage import PLEStorage
from qwen4_exp_hcu.ple.table import FORMATS, PLETable
from qwen4_exp_hcu.tiny import load_config

TARGETS = {
    "gfx906": GPUTarget("hip", "gfx906", 64),
    "gfx90a": GPUTarget("hip", "gfx90a", 64),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "sm80": GPUTarget("cuda", 80, 32),
    "sm90": GPUTarget("cuda", 90, 32),
}
ARTIFACTS = {"hip": {"amdgcn", "hsaco"}, "cuda": {"ptx", "cubin"}}


@dataclass(frozen=True)
class Launch:
    kernel: object  # the @triton.jit function
    args: tuple
    kwargs: dict


def _record(module, kernel_name: str, launcher, *args, **kwargs) -> Launch:
    """Run `launcher` with `module.<kernel_name>` swapped for a recorder: the launch it would make."""
    launches = []
    recorder = mock.MagicMock()
    recorder.__getitem__.return_value = lambda *a, **kw: launches.append((a, kw))
    kernel = getattr(module, kernel_name)
    with mock.patch.object(module, kernel_name, recorder):
        launcher(*args, **kwargs)
    assert len(launches) == 1, f"{launcher.__name__} launched {kernel_name} {len(launches)} times, expected once"
    return Launch(kernel, *launches[0])


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gather_launches(geometry: str, head_dim: int) -> dict[str, Launch]:
    """`PLETable.lookup`'s calls, per format: device tuning, host tuning (sorted ids), each with and without
    the hot-row cache where the format has one (BF16, INT8; the library caches host tables only, the
    launcher takes a cache with either tuning)."""
    ids = torch.zeros(3, 5, dtype=torch.int64)
    out = torch.empty(3, 5 * head_dim, dtype=torch.bfloat16)
    launches = {}
    for fmt in FORMATS:
        table = PLETable(64, head_dim, PLEStorage(fmt))
        # the scale and global scale as PLETable.lookup passes them
        scale = table.tensor_scale if fmt == "fp8" else table.scale
        global_scale = table.tensor_scale if fmt == "nvfp4" else None
        caches = {"": None}
        if fmt in ("bf16", "int8"):
            caches["-cache"] = HotRows(table.weight, table.scale, 0, 8, "cpu", observe=False).tensors
        for where, tuning in (("device", PLETable.DEVICE_TUNING), ("host", PLETable.HOST_TUNING)):
            for suffix, cache in caches.items():
                launches[f"gather-{fmt}-{where}{suffix}-{geometry}"] = _record(
                    gather_dequant, "_gather_dequant_kernel", gather_dequant.gather_dequant,
                    ids, table.weight, scale, table.start, out, global_scale=global_scale, cache=cache, **tuning,
                    **table.format.kernel_args,
                )  # fmt: skip
    return launches


def _hash_launches(geometry: str, spec: NgramHashSpec) -> dict[str, Launch]:
    """`ngram_ids`' call: int32 token ids from vLLM, int64 from `PLEBatch.from_lengths`; int64 query start
    locations and n-gram context, as the PLE layer passes them."""
    qsl = torch.tensor([0, 3, 7])
    ctx = torch.full((2, spec.context_len), spec.eos_token_id)
    return {
        f"hash-ids_{_name(dtype)}-{geometry}": _record(
            ngram_hash, "_ngram_hash_kernel", ngram_hash.ngram_hash, spec, torch.arange(7, dtype=dtype), qsl, ctx
        )
        for dtype in (torch.int32, torch.int64)
    }


def _window_launches(cfg) -> dict[str, Launch]:
    """The PLE layer's window calls at the release's shape, int64 slots: the n-gram context's store (int64) and
    the conv window's store and conv (the model's dtype, any vLLM serves), plain and with verified drafts; the
    gate (norm weights in the model dtype, vLLM's default dtype while it builds the model)."""
    from qwen4_exp_hcu.ple.layer import state_shapes

    qsl, slots, init = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([2, -1]), torch.tensor([True, False])
    launches = {}
    for spec in (False, True):
        extra = 2 if spec else 0
        drafts = (torch.tensor([1, 1], dtype=torch.int32), torch.tensor([True, False])) if spec else (None, None)
        (ctx,), (window, width) = state_shapes(cfg, extra)
        suffix = "-spec" if spec else ""
        for ids in (torch.int32, torch.int64):  # token ids from vLLM, from `PLEBatch.from_lengths`
            launches[f"store-ngram-ids_{_name(ids)}{suffix}"] = _record(
                short_conv, "_store_window_kernel", short_conv.store_window,
                torch.zeros(4, ctx, 2, dtype=torch.int64)[..., 0],  # entries 2 apart: a stride of 1 would become a constant
                torch.zeros(4, dtype=ids), qsl, slots, init, *drafts, ctx - extra, NgramHashSpec.from_config(cfg, 0).eos_token_id,
            )  # fmt: skip
        launches[f"store-ngram-fill_1{suffix}"] = _record(  # a fill of 1 would be a constant if specialized
            short_conv, "_store_window_kernel", short_conv.store_window, torch.zeros(4, ctx, 2, dtype=torch.int64)[..., 0],
            torch.zeros(4, dtype=torch.int64), qsl, slots, init, *drafts, ctx - extra, 1,
        )  # fmt: skip
        for dtype in (torch.bfloat16,) if spec else (torch.bfloat16, torch.float16, torch.float32):
            state, x = torch.zeros(4, window, width, dtype=dtype), torch.zeros(4, width, dtype=dtype)
            weight = torch.zeros(width, cfg.ple_conv_kernel_size, dtype=dtype)
            launches[f"store-conv-{_name(dtype)}{suffix}"] = _record(
                short_conv, "_store_window_kernel", short_conv.store_window, state, x, qsl, slots, init, *drafts,
                window - extra, 0,
            )  # fmt: skip
            launches[f"conv-{_name(dtype)}{suffix}"] = _record(
                short_conv, "_short_conv_kernel", short_conv.short_conv, x, x, state, qsl, slots, init, drafts[0],
                weight, cfg.ngram_size,
            )  # fmt: skip
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        streams, weight = torch.zeros(4, width, dtype=dtype), torch.zeros(width, dtype=dtype)
        launches[f"gate-{_name(dtype)}"] = _record(
            ple_gate, "_ple_gate_kernel", ple_gate.ple_gate, streams, streams, torch.zeros(4, cfg.hidden_size, dtype=dtype),
            weight, weight, weight, 1e-6, cfg.hidden_size,
        )  # fmt: skip
    return launches


def _hyper_connection_launches(cfg) -> dict[str, Launch]:
    """A decoder layer's and the final mixer's calls at the release's shape, bf16: the injection fused with the
    norm, each alone, the silu over the merged GEMM's column slice, the mix with and without injection weights,
    the decode GEMM with its silu at one token and at 32."""
    hc, h, rank, t = cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank, 3
    streams, weight = torch.zeros(t, hc * h, dtype=torch.bfloat16), torch.zeros(hc * h, dtype=torch.bfloat16)
    pending = (torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, hc, dtype=torch.bfloat16))
    merged = torch.zeros(t, rank + hc + -(rank + hc) % 16, dtype=torch.bfloat16)  # rows padded as the model's
    norm = "_inject_norm_kernel"
    calls = {
        "inject-norm": (norm, hyper_connection.inject_norm, streams, weight, 1e-6, h, *pending),
        "norm": (norm, hyper_connection.inject_norm, streams, weight, 1e-6, h),
        "inject": (norm, hyper_connection.inject_norm, streams, None, 0.0, h, *pending),
        "silu": ("_scaled_silu_kernel", hyper_connection.scaled_silu, merged[:, :rank], float(hc)),
        "mix-weights": ("_gate_mix_kernel", hyper_connection.gate_mix, streams, streams, hc, merged[:, rank : rank + hc]),
        "mix": ("_gate_mix_kernel", hyper_connection.gate_mix, streams, streams, hc),
    }
    counts = torch.zeros(down_silu.DOWN_SILU_TILES, dtype=torch.int32)
    down_w = torch.zeros(rank + hc, hc * h, dtype=torch.bfloat16)  # the rows the model passes: not its padding
    # whole rows, and split-K dots: 16 K splits up to 16 tokens, 10 above
    for tokens, kernel in ((1, "_down_silu_rows_kernel"), (16, "_down_silu_kernel"), (32, "_down_silu_kernel")):
        normed = torch.zeros(tokens, hc * h, dtype=torch.bfloat16)
        calls[f"down-silu-{tokens}"] = (kernel, down_silu.down_silu, normed, down_w, rank, float(hc), counts)
    cold = down_silu.DownSiluConfig(warm_counter=False)  # 32 tokens, the counter first touched after the wait
    calls["down-silu-cold"] = ("_down_silu_kernel", down_silu.down_silu, normed, down_w, rank, float(hc), counts, cold)
    whole_rows = down_silu.DownSiluConfig(whole_rows=True)  # the most rows a program holds (MTP's 4 tokens)
    normed = torch.zeros(down_silu.WHOLE_ROWS_PER_PROGRAM, hc * h, dtype=torch.bfloat16)
    calls["down-silu-rows"] = ("_down_silu_rows_kernel", down_silu.down_silu, normed, down_w, rank, float(hc), counts, whole_rows)
    launches = {f"hc-{name}": _record(sys.modules[launcher.__module__], kernel, launcher, *args)
                for name, (kernel, launcher, *args) in calls.items()}  # fmt: skip
    # UPCAST is the CPU interpreter's fp32 detour (`_gemm_block`); a GPU runs bf16 dots, which is what compiles here
    return {name: Launch(l.kernel, l.args, {**l.kwargs, "UPCAST": False} if "UPCAST" in l.kwargs else l.kwargs)
            for name, l in launches.items()}  # fmt: skip


def _launches() -> dict[str, Launch]:
    launches = _hyper_connection_launches(text_config(census()["config"]["bf16_config_json"]))
    for geometry, cfg in (("tiny", load_config()), ("release", text_config(census()["config"]["bf16_config_json"]))):
        spec = NgramHashSpec.from_config(cfg, 0)  # the kernels' constexprs are the same for every PLE layer
        launches |= _gather_launches(geometry, spec.head_dim) | _hash_launches(geometry, spec)
    return launches | _window_launches(text_config(census()["config"]["bf16_config_json"]))


@triton.jit
def _fp8_decode_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """A native e4m3 -> fp32 conversion, which Ampere has not (`_gather_dequant_kernel` decodes with integer ops)."""
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.float32))


LAUNCHES = _launches()
# the hyper-connection kernels as a Hopper GPU launches them (`hyper_connection.launch_pdl`; the CPU stand-ins say no)
PDL_LAUNCHES = {f"{name}-pdl": Launch(launch.kernel, launch.args, {**launch.kwargs, "launch_pdl": True})
                for name, launch in LAUNCHES.items() if name.startswith("hc-")}  # fmt: skip
# not a kernel of ours: what shows the check can fail (the last test)
PROBES = {"fp8-decode": Launch(_fp8_decode_kernel, (torch.zeros(8, dtype=torch.float8_e4m3fn), torch.zeros(8)), dict(BLOCK=8))}


def aot_compile(launch: Launch, target: GPUTarget, specialize: bool):
    """`triton.compile` of `launch` for `target` with the signature, constexprs and options the JIT derives
    from the same arguments (as `JITFunction._pack_args` does); `specialize`: the value specializations the
    JIT makes for this target (16-byte alignment, AMD's 2 GiB buffer range), else none."""
    kernel, backend = launch.kernel, make_backend(target)
    bound = kernel.signature.bind(*launch.args, **{k: v for k, v in launch.kwargs.items() if k in kernel.arg_names})
    options = dict(launch.kwargs)  # as the JIT: the backend takes its options' names (num_warps, launch_pdl), if passed
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, bound.arguments.values())):
        if param.is_constexpr:
            ty, spec = "constexpr", ""
            constexprs[param.name] = value
        else:
            ty, spec = native_specialize_impl(
                type(backend), value, False, specialize and not param.do_not_specialize,
                specialize and not param.do_not_specialize_on_alignment,
            )  # fmt: skip  (as the JIT: a `do_not_specialize` argument stays a value)
            assert ty != "constexpr", f"{param.name}={value} is specialized to a constant: pick another stand-in"
        signature[param.name] = ty
        if spec is not None:  # None: not specialized, no attributes
            attrs[(i,)] = backend.parse_attr(spec)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)


def _compile_in_worker(variant: str, target: str, specialize: bool) -> dict:
    """Runs in a worker: the artifacts that came out and num_warps, or the error."""
    try:
        compiled = aot_compile((LAUNCHES | PDL_LAUNCHES | PROBES)[variant], TARGETS[target], specialize)
    except Exception:
        return {"error": traceback.format_exc()}
    return {"artifacts": {k for k, v in compiled.asm.items() if v}, "num_warps": compiled.metadata.num_warps,
            "launch_pdl": compiled.metadata.launch_pdl if TARGETS[target].backend == "cuda" else False,
            "griddepcontrol": sorted({w for w in ("griddepcontrol.wait", "griddepcontrol.launch_dependents")
                                      if w in compiled.asm.get("ptx", "")}),
            "cg_loads": sorted(set(re.findall(r"ld\.global\.cg[\w.]*", compiled.asm.get("ptx", "")))),
            "order": re.findall(r"griddepcontrol\.wait|ld\.global|bar\.sync|atom\.global|(?<![\w.])red\.global", compiled.asm.get("ptx", ""))}  # fmt: skip


@pytest.fixture(scope="module")
def compile_aot(request):
    """`compile_aot(variant, target, specialize)` -> `_compile_in_worker`'s answer. Spawned workers (one per
    core, at most 4: each imports torch) import Triton with the interpreter off; every selected compile
    test's case is submitted up front, so the workers compile in parallel."""
    workers = min(4, len(os.sched_getaffinity(0)))
    pool, futures = ProcessPoolExecutor(workers, mp_context=get_context("spawn")), {}

    def submit(*case):
        if case not in futures:
            with mock.patch.dict(os.environ, TRITON_INTERPRET="0"):  # workers start on submit, with this env
                futures[case] = pool.submit(_compile_in_worker, *case)
        return futures[case]

    for item in request.session.items:
        if getattr(item, "originalname", None) == test_kernel_compiles_ahead_of_time.__name__:
            submit(*(item.callspec.params[k] for k in ("variant", "target", "specialize")))
        elif getattr(item, "originalname", None) == test_hopper_launches_hyper_connection_kernels_dependently.__name__:
            submit(item.callspec.params["variant"], "sm90", True)
    try:
        yield lambda *case: submit(*case).result()
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("specialize", [True, False], ids=["specialized", "generic"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("variant", LAUNCHES)
def test_kernel_compiles_ahead_of_time(compile_aot, variant, target, specialize):
    result = compile_aot(variant, target, specialize)
    assert "error" not in result, result.get("error")
    assert ARTIFACTS[TARGETS[target].backend] <= result["artifacts"], result["artifacts"]
    assert result["num_warps"] == LAUNCHES[variant].kwargs.get("num_warps", 4)  # Triton's default: 4
    assert not result["launch_pdl"] and not result["griddepcontrol"]  # CPU stand-ins: no dependent launch


@pytest.mark.parametrize("variant", PDL_LAUNCHES)
def test_hopper_launches_hyper_connection_kernels_dependently(compile_aot, variant):
    """On Hopper each hyper-connection kernel is launched as a programmatic dependent (Triton's launch option) and
    waits for the kernel before it, then lets the next one start (`griddepcontrol` in its PTX): a kernel launched
    so without the wait would read its input before it is written."""
    result = compile_aot(variant, "sm90", True)
    assert "error" not in result, result.get("error")
    assert result["launch_pdl"]
    assert result["griddepcontrol"] == ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]


def test_down_silu_adds_its_partial_sums_in_vector_loads(compile_aot):
    """At the release's 324 columns (320 + 4, not a multiple of 16) the split-K launch's last split reads the
    partial sums 16 bytes at a time: masked by N itself they compile to scalar loads, and the serving profile's
    `down_silu` at b = 32 takes a quarter longer a step without the 12 zero padding rows."""
    result = compile_aot("hc-down-silu-32-pdl", "sm90", True)
    assert "error" not in result, result.get("error")
    assert result["cg_loads"] == ["ld.global.cg.v4.b32"]


def test_whole_row_down_silu_reads_x_in_one_round_trip(compile_aot):
    """At one token, after the wait for the previous kernel, every x load is issued before the one reduction across
    threads (one barrier): summed a K block at a time, the tail's loads waited for the head's reduction, two L2 round
    trips on the path of a launch that the decode step runs 97 times."""
    result = compile_aot("hc-down-silu-1-pdl", "sm90", True)
    assert "error" not in result, result.get("error")
    after_wait = result["order"][result["order"].index("griddepcontrol.wait") + 1 :]
    assert after_wait.count("bar.sync") == 1 and "ld.global" not in after_wait[after_wait.index("bar.sync") :], after_wait


def test_split_k_down_silu_defaults_by_rows():
    """Session 27's split-K launches, timed inside the whole block and served at b = 16: 16 splits of K blocks of 128
    up to 16 tokens, 10 of 256 above, each touching its tile counter early."""
    for tokens, split, block_k in ((16, 16, 128), (32, 10, 256)):
        kwargs = LAUNCHES[f"hc-down-silu-{tokens}"].kwargs
        assert (kwargs["SPLIT"], kwargs["BLOCK_K"], kwargs["WARM_COUNTER"]) == (split, block_k, True), kwargs
    assert not LAUNCHES["hc-down-silu-cold"].kwargs["WARM_COUNTER"]


def test_split_k_down_silu_can_touch_its_counter_before_the_wait(compile_aot):
    """`warm_counter` (the default): the tile counter's add of 0 is issued with the first weights, before the wait
    for the previous kernel, as a reduction (`red`: nothing waits for a result); without it the only atomics come
    after the wait (the count and the reset, `atom`: their results are read)."""
    for variant, before in (("hc-down-silu-32-pdl", ["red.global"]), ("hc-down-silu-cold-pdl", [])):
        result = compile_aot(variant, "sm90", True)
        assert "error" not in result, result.get("error")
        order = result["order"]
        wait = order.index("griddepcontrol.wait")
        assert [op for op in order[:wait] if op in ("atom.global", "red.global")] == before, order
        assert [op for op in order[wait:] if op in ("atom.global", "red.global")] == ["atom.global"] * 2, order


def test_a_kernel_a_target_cannot_compile_fails(compile_aot):
    """The check can fail: a native fp8 e4m3 decode compiles for Hopper and is an error for Ampere."""
    assert "error" not in compile_aot("fp8-decode", "sm90", True)
    assert "fp8e4nv not supported in this architecture" in compile_aot("fp8-decode", "sm80", True)["error"]
