"""docs/PERFORMANCE.md's figures are what the committed result files hold: `python -m benchmarks.figures` renders
them from benchmarks/results/, and `--check` fails on a page whose tables differ."""

import shutil

import pytest

from benchmarks import figures


def test_every_row_reads_its_files_and_names_a_command():
    for _, rows in figures.FAMILIES:
        for row in rows:
            what, figure, timing, limit, files, commands = figures.cells(row, figures.RESULTS)
            assert figure and timing and limit, row.what
            assert all((figures.RESULTS / name).is_file() for name in row.files), row.files
            assert commands.startswith("`"), row.what


def test_the_committed_page_is_current():
    assert figures.main(["--check"]) == 0, "docs/PERFORMANCE.md is stale: run `python -m benchmarks.figures`"


@pytest.fixture
def page(tmp_path):
    copy = tmp_path / "PERFORMANCE.md"
    shutil.copy(figures.DOC, copy)
    return copy


def test_a_stale_table_fails_the_check_and_is_rewritten(page):
    text = page.read_text()
    assert "**0.506×**" in text  # the host-bytes row
    page.write_text(text.replace("**0.506×**", "**0.406×**"))
    assert figures.main(["--check", "--doc", str(page)]) == 1
    assert figures.main(["--doc", str(page)]) == 0
    assert page.read_text() == text
    assert figures.main(["--check", "--doc", str(page)]) == 0


def test_a_page_without_the_markers_is_refused(page):
    page.write_text(page.read_text().replace(figures.END, ""))
    with pytest.raises(ValueError, match="marker"):
        figures.main(["--check", "--doc", str(page)])


def test_rounds_give_their_median_and_range():
    """Three rounds of a pair (VARIANT, VARIANT#2, VARIANT#3): the median ratio and its min–max, not one round's."""
    results = {}
    for suffix, ours, ref in (("", 100.0, 100.0), ("#2", 90.0, 100.0), ("#3", 120.0, 100.0)):
        results["host_int8" + suffix] = {"decode_tokens_per_s": {"1": ours}, "decode_wall_tokens_per_s": {"1": ours}}
        results["gpu_int8" + suffix] = {"decode_tokens_per_s": {"1": ref}, "decode_wall_tokens_per_s": {"1": ref}}
    cells = figures.serve_decode("host_int8", "gpu_int8", [{"results": results}])
    assert "**1.000 (0.900–1.200)**" in cells.figure and "3 rounds" in cells.figure
    assert cells.timing == "wall 1.000 (0.900–1.200)"  # no profile: no GPU-active time


def test_one_round_says_so_and_gpu_active_is_the_reference_over_ours():
    profile = lambda us: {"1": {"gpu_active_us_per_step": us}}  # noqa: E731
    results = {"host_int8": {"decode_tokens_per_s": {"1": 50.0}, "decode_profile": profile(200.0)},
               "gpu_int8": {"decode_tokens_per_s": {"1": 40.0}, "decode_profile": profile(300.0)}}
    cells = figures.serve_decode("host_int8", "gpu_int8", [{"results": results}])
    assert cells.figure == "b = 1: **1.250**; 1 round"
    assert cells.timing == "GPU-active 1.500"


def test_kernel_benchmarks_read_one_file_a_round():
    """bench_prefetch and bench_hyper_connection rounds (one file each): the median ratio and its min–max."""
    step = lambda host, ref: {"host + prefetch": {"graph_ms": host, "eager_ms": host},  # noqa: E731
                              "GPU-resident": {"graph_ms": ref, "eager_ms": ref}, "lookup_host_ms": 0.5}
    docs = [{"params": {"repeats": 3}, "results": {"64": step(host, 1.0)}} for host in (1.02, 0.98, 1.10)]
    cells = figures.prefetch("host + prefetch", docs)
    assert "**1.020 (0.980–1.100)** in CUDA-graph replay" in cells.figure and "3 rounds" in cells.figure
    hc = [{"results": {"1": {"ratio_pdl": r, "max_abs_diff": {"kernels": d}}}} for r, d in ((1.1, 0.5), (1.3, 0.25), (1.2, 0))]
    cells = figures.hc_ratio("ratio_pdl", hc)
    assert cells.figure == "1 tokens: **1.20 (1.10–1.30)×**; 3 rounds: median (min–max)"
    assert cells.limit == "largest output difference 0.5"
