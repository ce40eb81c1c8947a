"""Benchmark scripts (`python -m benchmarks.NAME`); each writes a JSON report and a PNG beside it."""

import json
import os
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


def drop_page_cache(path: str | Path) -> None:
    """Ask the kernel to forget a file's cached pages (cold-start measurements). Written pages are flushed first:
    the kernel drops clean pages only, so a file just written would otherwise stay cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
