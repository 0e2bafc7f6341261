"""Trustworthy step-time ratios on a noisy machine: interleaved rounds, median, spread.

A shared machine's speed drifts by tens of percent within a minute, so two points timed one after
the other compare the machine's load, not the points. Every step-time ratio slimact reports is
therefore taken like this:

    rounds:   A B C | A B C | A B C | ...     (one call of each point per round, same order)
    ratio_r = t_r(point) / t_r(baseline)      (per round: both saw about the same load)
    report    median_r(ratio_r), with min-max and the interquartile range, n = rounds

plus the 1-minute load average before and after. ``interleaved`` runs the rounds (with
``alternate=True`` every other round in reverse, A B C | C B A, for long rounds whose load drifts
within them: the compiled planner's 21 options); ``RatioStats.of`` turns per-round ratios into
a :class:`RatioStats`. Where a difference is smaller than one run's spread (a bar met by less
than the rounds vary), :func:`median_ci` gives the median's confidence interval (scipy's bootstrap over
rounds), and runs of the same command pool their rounds: the bar is met where the whole
interval is under it, missed where the whole interval is over it, and otherwise too close to
call on this machine.
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy.stats import bootstrap

# scipy >= 1.15 seeds by ``rng`` (SPEC 7); older releases (the floor is 1.9) by ``random_state``
_SEED_ARG = "rng" if "rng" in inspect.signature(bootstrap).parameters else "random_state"


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class RatioStats:
    """Median of per-round ratios with its spread (min-max and IQR) over ``n`` rounds."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> RatioStats:
        if not values:
            raise ValueError("RatioStats.of needs at least one value")
        v = sorted(values)
        if len(v) >= 2:
            q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive")
        else:
            q1 = q3 = v[0]
        return cls(statistics.median(v), v[0], v[-1], q1, q3, len(v))

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.median:.3f} [{self.min:.3f}-{self.max:.3f}, n={self.n}]"


def median_ci(
    values: Sequence[float], level: float = 0.95, resamples: int = 9999, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median of ``values`` (per-round ratios;
    rounds are the resampled unit), reproducible from ``seed``."""
    if len(values) < 2:
        raise ValueError(f"median_ci needs at least two values, got {len(values)}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"median_ci: level must be in (0, 1), got {level}")
    res = bootstrap(
        (np.asarray(values, dtype=np.float64),),
        np.median,
        confidence_level=level,
        n_resamples=resamples,
        method="percentile",
        **{_SEED_ARG: np.random.default_rng(seed)},
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def verdict(ci: tuple[float, float], bar: float) -> str:
    """``met`` (the whole interval at or under ``bar``), ``missed`` (over it) or ``too close``."""
    low, high = ci
    return "met" if high <= bar else "missed" if low > bar else "too close"


@dataclass(frozen=True)
class Timing:
    """Per-round seconds of every point, and the load average around the rounds."""

    times: dict[str, list[float]]
    load_before: float | None
    load_after: float | None

    def median_s(self, name: str) -> float:
        return statistics.median(self.times[name])

    def ratio(self, name: str, baseline: str) -> RatioStats:
        """Median of per-round ``t(name) / t(baseline)``, with its spread."""
        a, b = self.times[name], self.times[baseline]
        return RatioStats.of([x / y for x, y in zip(a, b) if y > 0])

    def to_dict(self, baseline: str | None = None) -> dict:
        out: dict = {
            "rounds": len(next(iter(self.times.values()), [])),
            "load_before": self.load_before,
            "load_after": self.load_after,
            "median_s": {k: self.median_s(k) for k in self.times},
            "times_s": self.times,
        }
        if baseline is not None:
            out["ratio_vs_" + baseline] = {
                k: self.ratio(k, baseline).to_dict() for k in self.times if k != baseline
            }
        return out


def interleaved(
    points: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    alternate: bool = False,
) -> Timing:
    """Call every point once per round, in order, ``warmup`` untimed rounds first.

    ``alternate``: every other round in reverse order (A B C | C B A | ...). With many points a
    round lasts long enough for the load to drift within it, which a fixed order turns into a
    bias by position (the last point's ratio to the first takes the whole round's drift); in
    reversed rounds that bias changes sign, so the median over rounds cancels it."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    times: dict[str, list[float]] = {k: [] for k in points}
    load_before = load_average()
    order = list(points.items())
    for r in range(warmup + rounds):
        for name, fn in order[::-1] if alternate and r % 2 else order:
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return Timing(times, load_before, load_average())
