"""Phase 2 of a model case: every surviving point timed in interleaved rounds.

Phase 1 (:mod:`slimact.bench.runner`) measures the points one by one and keeps each one's
prepared model alive (weights only: gradients freed, the optimizer gone with its training run) as
a :class:`Live`. :func:`time_case` then runs ``slimact.timing.interleaved`` over all of them,
baseline first in every round (``none, p1, p2, ... | none, p1, p2, ... | ...``), ``warmup``
untimed rounds then ``timing_steps`` timed ones, so each round's points saw about the same machine
load. Each timed call is the point's step (``slimact.compare.train_step_fn``: forward+backward on
the measurement batch) and then its gradients freed, so only one model's gradients are alive at a
time. Per point it writes into the point's record:

- ``step_time_s``: median seconds of its forward+backward over the rounds;
- ``step_time_ratio``: median over rounds of ``t(point) / t(none)`` in the same round;
- ``step_time_ratio_spread``: that ratio's median/min/max/q1/q3 and ``n`` (= rounds),
  ``RatioStats.to_dict()`` (the baseline's is all 1.0);
- ``tokens_per_s``: tokens per step / ``step_time_s``.

It returns the case-level record (``meta.timing[<case>]``): rounds, warm-up, the 1-minute load
average before and after the rounds, their wall time, the points timed. A point whose step raises
during the rounds is dropped (``timing_error`` in its record) and the rounds restart without it;
if the baseline fails, no point gets a ratio.

A case with ``timing="pairs"`` instead times each point right after phase 1 measured it, in
rounds of its own against the baseline (:class:`PairTiming`: ``none, p | none, p | ...``), so
a run cut short keeps every finished point's ratio and only the baseline's model stays alive.
The baseline's ``step_time_s`` is then the median of its calls in all pairs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from slimact.bench.cases import ModelCase
from slimact.timing import RatioStats, interleaved

Log = Callable[[str], None]
BASELINE = "none"


@dataclass
class Live:
    """A point measured in phase 1, kept for the timing rounds."""

    model: nn.Module
    step: Callable[[], None]  # ``slimact.compare.train_step_fn``: zero_grad, forward, backward
    restore: Callable[[], None] = field(default=lambda: None)  # the anchor's undo, if any
    forward: Callable[..., torch.Tensor] | None = None  # (model, x, y) -> loss: other batches


class _PointFailed(Exception):
    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(name)
        self.name, self.error = name, error


def _guarded(name: str, kept: Live) -> Callable[[], None]:
    """The point's step, then its gradients freed (the step frees them first anyway, so each
    timed call does the same work, and only one model's gradients are alive at a time)."""
    step, model = kept.step, kept.model

    def call() -> None:
        try:
            step()
        except Exception as e:  # KeyboardInterrupt passes through
            raise _PointFailed(name, e) from e
        finally:
            model.zero_grad(set_to_none=True)

    return call


def time_case(case: ModelCase, live: dict[str, Live], records: dict[str, dict], log: Log) -> dict:
    """Interleaved rounds over ``live`` (baseline first); fills the timing keys of ``records``."""
    names = [n for n in live if n == BASELINE] + [n for n in live if n != BASELINE]
    failed: dict[str, str] = {}
    timing = None
    t0 = time.perf_counter()
    while names and BASELINE in names:
        steps = {n: _guarded(n, live[n]) for n in names}
        try:
            timing = interleaved(steps, rounds=case.timing_steps, warmup=case.warmup)
            break
        except _PointFailed as e:
            failed[e.name] = f"{type(e.error).__name__}: {e.error}".strip()
            names.remove(e.name)
            log(f"  {case.label:<22} {e.name:<26} timing failed: {failed[e.name][:150]}")
    if timing is None:  # the baseline failed: nothing to take a ratio against
        failed.update({n: f"not timed: baseline failed ({failed.get(BASELINE)})" for n in names})
    for name, error in failed.items():
        records[name].update(timing_error=error, step_time_s=None, step_time_ratio=None)
    out = {
        "case": case.label,
        "rounds": case.timing_steps,
        "warmup": case.warmup,
        "points": list(timing.times) if timing else [],
        "load_before": timing.load_before if timing else None,
        "load_after": timing.load_after if timing else None,
        "wall_s": time.perf_counter() - t0,
        "failed": failed,
    }
    if timing is None:
        return out
    for name in timing.times:
        s = timing.median_s(name)
        ratio = timing.ratio(name, BASELINE)
        records[name].update(
            step_time_s=s,
            step_time_ratio=ratio.median,
            step_time_ratio_spread=ratio.to_dict(),
            tokens_per_s=case.tokens_per_step / s if s > 0 else None,
        )
        log(f"  {case.label:<22} {name:<26} step {s:7.3f} s  ratio {ratio}")
    return out


def release(live: dict[str, Live], device: torch.device) -> None:
    """Undo every kept point's anchor and drop its model (then give CUDA its cache back)."""
    for kept in live.values():
        kept.restore()
    live.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class PairTiming:
    """Timing by pairs (module docstring): :meth:`time` after each point, :meth:`summary` for
    ``meta.timing[<case>]``."""

    def __init__(self, case: ModelCase, base: Live, records: dict[str, dict], log: Log) -> None:
        self.case, self.base, self.records, self.log = case, base, records, log
        self.base_times: list[float] = []
        self.timed: list[str] = []
        self.failed: dict[str, str] = {}
        self.loads: list[float | None] = []
        self.wall_s = 0.0

    def time(self, name: str, kept: Live) -> None:
        """Rounds of (baseline, ``name``); fills the timing keys of both records."""
        t0 = time.perf_counter()
        steps = {BASELINE: _guarded(BASELINE, self.base), name: _guarded(name, kept)}
        try:
            timing = interleaved(steps, rounds=self.case.timing_steps, warmup=self.case.warmup)
        except _PointFailed as e:
            error = f"{type(e.error).__name__}: {e.error}".strip()
            failed = name if e.name == name else BASELINE
            self.failed[name] = error if failed == name else f"baseline failed: {error}"
            self.records[name].update(
                timing_error=self.failed[name], step_time_s=None, step_time_ratio=None
            )
            self.log(f"  {self.case.label:<22} {name:<26} timing failed: {error[:150]}")
            return
        finally:
            self.wall_s += time.perf_counter() - t0
        self.loads += [timing.load_before, timing.load_after]
        self.timed.append(name)
        s, ratio = timing.median_s(name), timing.ratio(name, BASELINE)
        self.records[name].update(
            step_time_s=s,
            step_time_ratio=ratio.median,
            step_time_ratio_spread=ratio.to_dict(),
            tokens_per_s=self.case.tokens_per_step / s if s > 0 else None,
            baseline_step_time_s=timing.median_s(BASELINE),
        )
        self.base_times += timing.times[BASELINE]
        base = statistics.median(self.base_times)
        self.records[BASELINE].update(
            step_time_s=base,
            step_time_ratio=1.0,
            step_time_ratio_spread=RatioStats.of([1.0] * len(self.base_times)).to_dict(),
            tokens_per_s=self.case.tokens_per_step / base if base > 0 else None,
        )
        self.log(f"  {self.case.label:<22} {name:<26} step {s:7.3f} s  ratio {ratio}")

    def summary(self) -> dict:
        return {
            "case": self.case.label,
            "mode": "pairs",
            "rounds": self.case.timing_steps,
            "warmup": self.case.warmup,
            "points": [BASELINE, *self.timed] if self.timed else [],
            "load_before": self.loads[0] if self.loads else None,
            "load_after": self.loads[-1] if self.loads else None,
            "wall_s": self.wall_s,
            "failed": self.failed,
        }
