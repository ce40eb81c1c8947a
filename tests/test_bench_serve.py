"""`benchmarks/bench_serve.py`'s profile arithmetic on a made-up GPU timeline: merged busy intervals across
streams, idle gaps placed in time, and only the decode steps' gaps counted."""

from types import SimpleNamespace

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
    """The prefill-only run spanned 50 µs: a long gap inside that span is the prefill's, one of IDLE_GAP_US or more
    after it a decode step's, a shorter one a launch's latency."""
    long = bench_serve.IDLE_GAP_US
    gaps = [(10, long + 5, "p", "q"), (60, long, "s", "t"), (80, long - 1, "t", "u")]
    assert bench_serve.decode_gaps(gaps, prefill_span=50) == [(long, "s", "t")]
    assert bench_serve._timeline([]) == (0.0, {}, [], 0.0)
