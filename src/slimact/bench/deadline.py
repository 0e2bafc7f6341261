"""Time limits for a bench run: a hard limit per point and a soft budget for the whole suite.

A lent GPU comes for a few minutes, so a suite must end on time and leave what it measured:

* :func:`time_limit` arms ``SIGALRM`` (``setitimer``) around one point; when it fires, the
  handler raises :class:`PointTimeout` in the main thread, wherever Python is (a compile, a
  timing round, a wait on a worker thread). It derives from ``BaseException`` so that the
  ``except Exception`` of the code it interrupts (dynamo's fallbacks, a strategy's all-or-nothing
  undo) does not swallow it; the runner catches it and records the point as timed out. Work
  running in another thread (``compiled-auto`` plans in a worker thread) is not stopped by it:
  :func:`planner_threads` says whether any is still running, and the runner notes it. Where
  ``SIGALRM`` does not exist (Windows) or outside the main thread, no limit is armed (the
  record says so).
* :class:`Deadline`: the suite's budget; ``remaining()`` is what the next point may use, so the
  runner limits each point to ``min(point limit, remaining)`` and skips the points it cannot
  start, and a phase that must still run afterwards (max batch) gets time held back for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from slimact.utils import PLANNER_THREAD


class PointTimeout(BaseException):
    """A point ran past its time limit (raised by :func:`time_limit`'s alarm)."""


def can_limit() -> bool:
    """Whether :func:`time_limit` can arm a limit here (SIGALRM, main thread)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise :class:`PointTimeout` in the block once ``seconds`` have passed (None: no limit;
    nothing is armed where :func:`can_limit` is false). ``what`` names the work in the message."""
    if seconds is None or not can_limit():
        yield
        return
    if seconds <= 0:
        raise PointTimeout(f"{what}: no time left (limit {seconds:.0f} s)")

    def fire(signum, frame):  # noqa: ARG001
        raise PointTimeout(f"{what}: ran past its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def planner_threads() -> int:
    """How many planner worker threads are still alive (after a timed-out point)."""
    return sum(t.name == PLANNER_THREAD and t.is_alive() for t in threading.enumerate())


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``. While a timed-out point's planner still runs in its daemon
    thread, a normal interpreter exit would finalize torch under it (the process then aborts,
    exit 134, after the results were written): the output is flushed and the process ends at
    once instead. For process entry points only (``slimact``, ``python -m slimact.bench``)."""
    if planner_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class Deadline:
    """A time budget started at construction (``seconds`` None: unlimited)."""

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"a time budget must be > 0 seconds or None, got {seconds!r}")
        self.seconds = seconds
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def remaining(self, reserve: float = 0.0) -> float | None:
        """Seconds left, less ``reserve`` held back for a later phase (None: unlimited)."""
        if self.seconds is None:
            return None
        return self.seconds - reserve - self.elapsed()

    def limit(self, per_point: float | None, reserve: float = 0.0) -> float | None:
        """The limit of the next piece of work: ``per_point``, cut to what is left."""
        left = self.remaining(reserve)
        if left is None:
            return per_point
        return left if per_point is None else min(per_point, left)
