"""The launch count of one eager training step, on the CUDA code path, counted on a CPU.

``slimact.bench.launches.count_step``: one forward + backward of llama-tiny (2 blocks, 2 x 64
tokens) after two warm-up steps, on the CUDA path (``ops.device_path.cuda_path``: the Triton
kernels under ``TRITON_INTERPRET=1``, the refs eager as on CUDA), counting Triton launches plus
aten ops, views and uninitialized allocations excluded (``launches.VIEW_OPS``,
``launches.ALLOC_OPS``). On a GPU each counted op is at least one kernel launch: this is the
host's share of an eager step, which bounds how fast the step can be.

The bounds (the eager-GPU issue's done-when), with ``none``'s count as the unit:

* ``int4``, ``int8``, ``int4@sr``: at most ``none`` + 3 per coded saved tensor (an encode of
  at most two kernels, a decode of one);
* ``invact``, ``chunked-ce``: at most ``none`` + 2 per reformulated op;
* ``auto@25%``: at most 1.3x ``none``.

A bound that does not hold yet is asserted as a *ratchet* instead: the count may not exceed
:data:`RATCHET`, the value measured when it was last lowered, so it can only go down; lower the
entry when a change cuts the count, and replace it by the bound once the bound holds. Today
every strategy but ``none`` is under the ratchet. The codecs decode in one launch and encode
in two (per group, ``int8``'s) or three (the outlier codec of ``int4``'s activations, SDPA v's
channel-wise codec), with no other op per saved tensor, but a step's verdict batch is one op
more and three launches per outlier or channel-wise encode are one more than the bound allows;
the reformulations (``invact``, ``chunked-ce``, ``auto``'s plan) have eager ops of their own.
``auto`` plans with launch counts in place of measured times
(:func:`times_by_count`), so that its plan, and its count, is the same in every run.
``pytest -s`` prints each count.
"""

from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import pytest

from slimact.bench.launches import OpCounter, StepCount, count_step, counting_launches
from slimact.ops import device_path
from slimact.ops.quant import triton_available
from slimact.planner import codecstats, profiler, reforms

pytestmark = pytest.mark.skipif(
    not (triton_available() and device_path.interpreter_on()),
    reason="needs triton and TRITON_INTERPRET=1 (tests/conftest.py sets it)",
)

AUTO = "auto@25%,repeats=1,cache=None"
# spec -> the most it may count while its bound does not hold (module docstring)
RATCHET = {
    "int4": 351,
    "int8": 320,
    "int4@sr": 359,
    "invact": 327,
    "chunked-ce": 259,
    AUTO: 329,
}
_COUNTS: dict[str, StepCount] = {}


def _count_of(fn) -> float:
    counter = OpCounter()
    with counting_launches(counter):
        fn()
    return float(counter.total)


def _median_count(fn, repeats, device, warmup=True) -> float:
    if warmup:
        fn()
    return _count_of(fn)


def _count_delta(new, old, repeats, device) -> float:
    new(), old()  # warm-up, as measure.time_delta
    return _count_of(new) - _count_of(old)


def times_by_count() -> ExitStack:
    """The planner's measured times replaced by launch counts (one op or launch: one unit):
    ``auto`` then solves the same plan in every run, the one of fewest launches within its
    budget, where measured times on a shared CPU gave plans of 329 to 346."""
    stack = ExitStack()
    for module in (profiler, codecstats):
        stack.enter_context(mock.patch.object(module, "median_time", _median_count))
    stack.enter_context(mock.patch.object(reforms, "time_delta", _count_delta))
    return stack


def counted(spec: str) -> StepCount:
    if spec not in _COUNTS:
        with times_by_count() if spec == AUTO else ExitStack():
            _COUNTS[spec] = count_step(spec)
        print(f"\n{_COUNTS[spec].summary()}")
    return _COUNTS[spec]


def bound(spec: str) -> float:
    none, c = counted("none").total, counted(spec)
    if spec == AUTO:
        return 1.3 * none
    if spec in ("invact", "chunked-ce"):
        return none + 2 * c.reformulated
    return none + 3 * c.coded


def test_none_counts_what_its_step_runs():
    c = counted("none")
    assert c.coded == 0 and c.reformulated == 0 and not c.launches
    assert c.ops["aten::mm"] > 0 and not set(c.ops) & {"aten::view", "aten::empty"}


@pytest.mark.parametrize("spec", ["int4", "int8", "int4@sr", "invact", "chunked-ce", AUTO])
def test_launch_count_within_its_bound_or_its_ratchet(spec):
    c = counted(spec)
    if spec in ("int4", "int8", "int4@sr"):
        assert c.coded > 0 and sum(c.launches.values()) > 0  # the Triton path ran
    if spec in ("invact", "chunked-ce"):
        assert c.reformulated > 0
    limit = RATCHET.get(spec, bound(spec))
    assert c.total <= limit, (
        f"{spec}: {c.total} ops + launches, over {limit:g} (none {counted('none').total}, "
        f"bound {bound(spec):g}); {c.summary(20)}"
    )
    if spec in RATCHET:
        assert c.total > bound(spec), f"{spec} meets its bound now: replace its ratchet by it"
