"""Benchmark scripts (`python -m benchmarks.NAME`); each writes a JSON report and a PNG beside it. What they share
is in `benchmarks.common`: no script imports another."""
