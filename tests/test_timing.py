"""Interleaved timing: call order, per-round ratios, median and spread."""

from __future__ import annotations

import random
import statistics

import pytest

from slimact import timing
from slimact.timing import RatioStats, interleaved, median_ci, verdict


def test_ratio_stats_median_spread_and_quartiles():
    r = RatioStats.of([1.3, 1.0, 1.1, 5.0, 1.2])
    assert (r.median, r.min, r.max, r.n) == (1.2, 1.0, 5.0, 5)
    assert r.q1 == pytest.approx(1.1) and r.q3 == pytest.approx(1.3)
    assert str(r) == "1.200 [1.000-5.000, n=5]"
    assert RatioStats.of([2.0]).to_dict() == {
        "median": 2.0, "min": 2.0, "max": 2.0, "q1": 2.0, "q3": 2.0, "n": 1,
    }  # fmt: skip
    with pytest.raises(ValueError, match="at least one value"):
        RatioStats.of([])


def test_interleaved_runs_points_in_rounds_and_ratios_are_per_round(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls: list[str] = []
    # the machine slows down 10x between rounds; per-round ratios stay exact, medians do not
    speed = {"round": 0}

    def point(name: str, cost: float):
        def fn():
            calls.append(name)
            clock[0] += cost * (10 ** (speed["round"] % 2))
            if name == "b":
                speed["round"] += 1

        return fn

    t = interleaved({"a": point("a", 1.0), "b": point("b", 1.5)}, rounds=4, warmup=1)
    assert calls == ["a", "b"] * 5  # one warm-up round, then 4 timed rounds, always a then b
    assert len(t.times["a"]) == 4
    r = t.ratio("b", "a")
    assert r.median == pytest.approx(1.5) and r.min == pytest.approx(1.5)
    assert r.max == pytest.approx(1.5) and r.n == 4
    d = t.to_dict(baseline="a")
    assert d["rounds"] == 4 and d["ratio_vs_a"]["b"]["median"] == pytest.approx(1.5)


def test_interleaved_alternate_cancels_drift_within_a_round(monkeypatch):
    """The load grows through each round (every call costs 10% more than the one before it):
    in a fixed order the last point's ratio to the first takes the drift; alternating the
    order brings the median close to the points' true ratio (1: they cost the same)."""
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls: list[str] = []

    def point(name: str):
        def fn():
            calls.append(name)
            slow = 1.1 ** (len(calls) % 3 or 3)  # the drift restarts each round of three calls
            clock[0] += slow

        return fn

    points = {n: point(n) for n in "abc"}
    fixed = interleaved(points, rounds=4, warmup=0)
    assert fixed.ratio("c", "a").median == pytest.approx(1.21)  # all drift, no difference
    calls.clear()
    alt = interleaved(points, rounds=4, warmup=0, alternate=True)
    assert calls[:6] == ["a", "b", "c", "c", "b", "a"]
    # rounds give 1.21 and 1 / 1.21: their median is 1.018, the drift's bias down from 21% to 2%
    assert alt.ratio("c", "a").median == pytest.approx(1.0, abs=0.02)
    assert alt.ratio("b", "a").median == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("rounds, warmup, msg", [(0, 1, "rounds must be >= 1, got 0"),
                                                 (2, -1, "warmup must be >= 0, got -1")])  # fmt: skip
def test_interleaved_rejects_bad_counts(rounds, warmup, msg):
    with pytest.raises(ValueError, match=msg):
        interleaved({"a": lambda: None}, rounds=rounds, warmup=warmup)


def test_median_ci_brackets_the_median_narrows_with_rounds_and_is_reproducible():
    rng = random.Random(0)
    few = [1.0 + rng.gauss(0, 0.05) for _ in range(15)]
    many = [1.0 + rng.gauss(0, 0.05) for _ in range(200)]
    lo, hi = median_ci(few)
    assert lo <= statistics.median(few) <= hi
    lo2, hi2 = median_ci(many)
    assert lo2 <= statistics.median(many) <= hi2 and hi2 - lo2 < hi - lo
    assert 0.98 < lo2 < 1.0 < hi2 < 1.02  # the true median (1.0) inside, within 2%
    assert median_ci(few, seed=3) == median_ci(few, seed=3)


@pytest.mark.parametrize(
    "values, level, msg",
    [([1.0], 0.95, "at least two values, got 1"), ([1.0, 2.0], 1.5, r"level must be in \(0, 1\)")],
)
def test_median_ci_rejects_bad_input(values, level, msg):
    with pytest.raises(ValueError, match=msg):
        median_ci(values, level=level)


@pytest.mark.parametrize(
    "ci, want", [((0.99, 1.0), "met"), ((1.001, 1.2), "missed"), ((0.99, 1.01), "too close")]
)
def test_verdict_reads_the_whole_interval_against_the_bar(ci, want):
    assert verdict(ci, 1.0) == want
