"""Benchmark scripts (`python -m benchmarks.NAME`); each writes a JSON report and a PNG beside it."""

import json
from collections.abc import Callable
from pathlib import Path


def save(out: str | Path, stem: str, report: dict, plot: Callable[[dict, Path], None]) -> None:
    """`report` as `out/stem.json`, and `plot(report, out/stem.png)` (matplotlib without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(report, out / f"{stem}.png")
