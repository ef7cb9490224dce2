"""Metric arithmetic on a synthetic timeline whose figures are worked out by hand below."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninefold.bench.serve import best_rate
from ninefold.bench.serve_metrics import (
    SLO,
    RequestResult,
    compute_report,
    latency_stats,
    output_tokens_over_time,
    running_over_time,
)

# A: sent 0.0, chunks 0.10 0.15 0.25, done 0.30, 3 tokens -> TTFT 100, ITL 50 100, E2E 300, TPOT 200/2 = 100 ms
# B: sent 0.2, chunks 0.50 0.52, done 0.60, 4 tokens (a chunk held several) -> TTFT 300, ITL 20, E2E 400,
#    TPOT 100/3 ms
# C: failed after 50 ms
# D: sent 0.4, one chunk at 0.45 and done, 1 token -> TTFT 50, no ITL, E2E 50, no TPOT
TIMELINE = [
    RequestResult(start=0.0, end=0.30, success=True, chunk_times=[0.10, 0.15, 0.25], prompt_tokens=10, output_tokens=3),
    RequestResult(start=0.2, end=0.60, success=True, chunk_times=[0.50, 0.52], prompt_tokens=20, output_tokens=4),
    RequestResult(start=0.3, end=0.35, success=False, prompt_tokens=5, error="HTTP 500"),
    RequestResult(start=0.4, end=0.45, success=True, chunk_times=[0.45], prompt_tokens=30, output_tokens=1),
]


def test_per_request_latencies():
    a, b, _, d = TIMELINE
    assert a.ttft == pytest.approx(0.10) and a.e2e == pytest.approx(0.30) and a.tpot == pytest.approx(0.10)
    assert a.itls == pytest.approx([0.05, 0.10])
    assert b.ttft == pytest.approx(0.30) and b.tpot == pytest.approx(0.1 / 3) and b.itls == pytest.approx([0.02])
    assert d.ttft == pytest.approx(0.05) and d.tpot is None and d.itls == []


def test_report_figures():
    report = compute_report(TIMELINE, duration_s=1.0, slo=SLO())
    assert (report["completed"], report["failed"]) == (3, 1)
    assert report["total_input_tokens"] == 60 and report["total_output_tokens"] == 8
    assert report["request_throughput"] == pytest.approx(3.0)
    assert report["output_token_throughput"] == pytest.approx(8.0)
    assert report["total_token_throughput"] == pytest.approx(68.0)
    # Linear-interpolation percentiles: p of sorted [x0, x1, x2] sits at index 2p.
    assert report["ttft_ms"] == pytest.approx({"mean": 150, "median": 100, "p90": 260, "p99": 296})
    assert report["itl_ms"] == pytest.approx({"mean": 170 / 3, "median": 50, "p90": 90, "p99": 99})
    assert report["e2e_ms"] == pytest.approx({"mean": 250, "median": 300, "p90": 380, "p99": 398})
    tpot = [100 / 3, 100]
    assert report["tpot_ms"] == pytest.approx(
        {"mean": 200 / 3, "median": 200 / 3, "p90": tpot[0] + 0.9 * (tpot[1] - tpot[0]),
         "p99": tpot[0] + 0.99 * (tpot[1] - tpot[0])}
    )
    # No SLO: every completed request counts, the failed one does not.
    assert report["goodput"] == pytest.approx(3.0) and report["slo_attainment"] == pytest.approx(0.75)


@pytest.mark.parametrize(
    "slo, good",
    [
        ("ttft=200ms", 2),  # B's 300 ms TTFT misses
        ("itl=60ms", 2),  # A's 100 ms gap misses; D has no gap
        ("tpot=50ms", 2),  # A's 100 ms TPOT misses; D has none
        ("e2e=0.35s", 2),  # B's 400 ms misses
        ("ttft=200,itl=60ms", 1),  # only D meets both
        ("ttft=1s,itl=1s,tpot=1s,e2e=1s", 3),  # everything completed meets these
        ("e2e=40ms", 0),
    ],
)
def test_goodput_and_attainment(slo, good):
    report = compute_report(TIMELINE, duration_s=2.0, slo=SLO.parse(slo))
    assert report["goodput"] == pytest.approx(good / 2.0)
    assert report["slo_attainment"] == pytest.approx(good / 4)


def test_bound_equal_to_measured_value_is_met():
    assert SLO.parse("ttft=100ms").met_by(RequestResult(0.0, 0.2, True, [0.1], output_tokens=1))


def test_slo_parsing_units():
    slo = SLO.parse("ttft=500ms, itl=0.05s ,e2e=2000,tpot=250us")
    assert slo.as_dict() == pytest.approx({"ttft_ms": 500, "itl_ms": 50, "tpot_ms": 0.25, "e2e_ms": 2000})
    assert SLO.parse(None).empty and SLO.parse("").empty and not slo.empty


@pytest.mark.parametrize("text", ["foo=1ms", "ttft", "ttft=abc", "ttft=-1ms", "ttft=0", "ttft=1,ttft=2", "ttft=5min"])
def test_slo_parsing_rejects(text):
    with pytest.raises(ValueError, match="--slo"):
        SLO.parse(text)


def test_empty_and_all_failed_runs():
    assert latency_stats([]) == {"mean": None, "median": None, "p90": None, "p99": None}
    report = compute_report([TIMELINE[2]], duration_s=1.0, slo=SLO())
    assert report["completed"] == 0 and report["failed"] == 1 and report["goodput"] == 0
    assert report["ttft_ms"]["p99"] is None and report["slo_attainment"] == 0
    assert compute_report([], duration_s=1.0, slo=SLO())["slo_attainment"] is None
    with pytest.raises(ValueError, match="duration_s"):
        compute_report(TIMELINE, duration_s=0.0, slo=SLO())


def test_running_requests_over_time():
    times, counts = running_over_time(TIMELINE)
    # Intervals: A [0, .3], B [.2, .6], C [.3, .35], D [.4, .45]; at .3 A ends as C starts.
    at = lambda t: counts[np.searchsorted(times, t, side="right") - 1]
    assert [at(t) for t in (0.1, 0.25, 0.32, 0.37, 0.42, 0.5, 0.7)] == [1, 2, 2, 1, 2, 1, 0]
    assert counts[-1] == 0 and counts.max() == 2


def test_output_throughput_over_time():
    starts, rate = output_tokens_over_time(TIMELINE, bin_s=0.25)
    # Bins [0, .25) [.25, .5) [.5, .75): A's 1+1 | A's 1 + D's 1 | B's 2+2 tokens (4 over 2 chunks).
    assert starts == pytest.approx([0.0, 0.25, 0.5])
    assert rate == pytest.approx([8.0, 8.0, 16.0])
    with pytest.raises(ValueError, match="bin_s"):
        output_tokens_over_time(TIMELINE, bin_s=0)


def test_best_rate_is_highest_rate_meeting_target():
    runs = [{"config": {"request_rate": r}, "slo_attainment": a} for r, a in
            [(1.0, 1.0), (2.0, 0.95), (4.0, 0.85), (3.0, 0.9), (8.0, None)]]
    assert best_rate(runs) == 3.0
    assert best_rate(runs, target=0.99) == 1.0
    assert best_rate(runs[2:3]) is None


def _percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks, written out (the reference for latency_stats)."""
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


timelines = st.lists(
    st.tuples(
        st.floats(0, 10), st.lists(st.floats(0.001, 2), max_size=6), st.floats(0, 1), st.booleans(),
        st.integers(1, 50),
    ),
    min_size=1,
    max_size=12,
)


def _build(spec) -> list[RequestResult]:
    results = []
    for start, gaps, tail, ok, extra_tokens in spec:
        chunks = list(np.cumsum([start, *gaps])[1:]) if ok else []
        end = (chunks[-1] if chunks else start) + tail
        results.append(RequestResult(start, end, ok, chunks, prompt_tokens=7, output_tokens=len(chunks) + extra_tokens))
    return results


@settings(max_examples=60, deadline=None)
@given(timelines, st.floats(1, 100), st.floats(0.01, 5))
def test_report_invariants_on_random_timelines(spec, duration, bound_s):
    results = _build(spec)
    loose = compute_report(results, duration, SLO())
    done = [r for r in results if r.success]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    if ttfts:
        for p, key in ((50, "median"), (90, "p90"), (99, "p99")):
            assert loose["ttft_ms"][key] == pytest.approx(1e3 * _percentile(ttfts, p))
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        stats = loose[key]
        if stats["mean"] is not None:
            assert stats["median"] <= stats["p90"] + 1e-9 <= stats["p99"] + 2e-9
    assert loose["goodput"] == pytest.approx(len(done) / duration)
    # Adding a bound can only lose requests, and every bound together loses at least as many as each.
    bounds = {k: 1e3 * bound_s for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")}
    all_bounds = compute_report(results, duration, SLO(**bounds))
    for key, value in bounds.items():
        one = compute_report(results, duration, SLO(**{key: value}))
        assert all_bounds["goodput"] <= one["goodput"] <= loose["goodput"]
    assert 0 <= all_bounds["slo_attainment"] <= loose["slo_attainment"] <= 1
