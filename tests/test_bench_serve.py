"""`benchmarks/bench_serve.py`'s arithmetic on made-up timings: merged busy intervals across streams, idle gaps
placed in time, only the added decode steps' gaps counted, and the decode rate free of a request's fixed cost."""

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
    """The shorter run spanned 50 µs: a long gap inside that span is its own, one of IDLE_GAP_US or more after it
    one of the steps the longer run adds, a shorter one a launch's latency."""
    long = bench_serve.IDLE_GAP_US
    gaps = [(10, long + 5, "p", "q"), (60, long, "s", "t"), (80, long - 1, "t", "u")]
    assert bench_serve.decode_gaps(gaps, short_span=50) == [(long, "s", "t")]
    assert bench_serve._timeline([]) == (0.0, {}, [], 0.0)


def test_decode_fit_cancels_a_requests_fixed_cost():
    """12.7 ms a step and 170 ms a request pays beyond its prefill and steps (session 13's H200 figures at one
    sequence): the slope gives the step, and the fixed part comes back; 64 tokens minus the prefill alone would
    have reported 15.4 ms a step."""
    short, long = bench_serve.DECODE_TOKENS
    prefill, step, fixed = 0.050, 0.0127, 0.170
    got_step, got_fixed_ms = bench_serve.decode_fit(prefill, prefill + fixed + short * step, prefill + fixed + long * step)
    assert abs(got_step - step) < 1e-12 and abs(got_fixed_ms - fixed * 1e3) < 1e-9
    assert abs((fixed + long * step) / long - 0.0154) < 1e-4
