"""No test asserts a relation between two measured wall-clock times.

Two measured durations (or a ratio of them against a bound) move with the machine's load: such an
assert fails on a busy CI runner while the code is right. A test asserts what the code decides
given its measurements (inject the times, or assert structure) instead. This scans every test
module's ``assert`` statements with ``ast`` for an ordering comparison (``<``, ``<=``, ``>``,
``>=``) between two operands that read as durations (``forward_s``, ``step_time_s``,
``elapsed``, ``time.perf_counter() - t0`` ...), or of a step-time ratio against a bound other
than 0. Configured limits (``timeout_s``, ``time_budget_s``, ...) are not measured; an assert
on times a test wrote itself (a synthetic profile's) says so on its line: ``# injected times``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
# a measured duration's name, by its words (split at "_"): the last one a unit (``forward_s``),
# any one a time word (``times_a``, ``elapsed``), or ``t_<what>``
UNITS = {"s", "ms", "us", "ns", "sec", "secs"}
WORDS = {"time", "times", "seconds", "elapsed", "duration", "durations"}
CONFIGURED = re.compile(r"timeout|budget|limit|deadline|reserve|window|interval|max_|min_")
RATIO = re.compile(r"(time|step)_?ratio")
INJECTED = "# injected times"  # the marker of an assert on times the test wrote itself
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns"}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
    return None


def _kind(node: ast.AST) -> str | None:
    """'duration', 'ratio' (of two durations) or None, for an operand of a comparison."""
    if isinstance(node, ast.Call):
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        owner = getattr(f.value, "id", None) if isinstance(f, ast.Attribute) else None
        if fname in CLOCKS and owner in (None, "time"):
            return "duration" if fname != "time" or owner == "time" else None
        if fname in ("min", "max", "sum", "median", "abs", "float"):
            kinds = {_kind(a) for a in node.args}
            return "duration" if "duration" in kinds else ("ratio" if "ratio" in kinds else None)
        return None
    if isinstance(node, ast.BinOp):
        left, right = _kind(node.left), _kind(node.right)
        if isinstance(node.op, ast.Div) and left == right == "duration":
            return "ratio"
        if isinstance(node.op, (ast.Add, ast.Sub)) and "duration" in (left, right):
            return "duration"
        if isinstance(node.op, (ast.Mult, ast.Div)):
            return left or right
        return None
    name = _name(node)
    if name is None:
        return None
    low = name.lower()
    if RATIO.search(low):
        return "ratio"
    words = low.split("_")
    timed = words[-1] in UNITS or bool(WORDS & set(words)) or (words[0] == "t" and len(words) > 1)
    return "duration" if timed and not CONFIGURED.search(low) else None


def _nonzero_number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
        and node.value != 0
    )


def timing_asserts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every assert in ``source`` comparing two measured times (module doc)."""
    found = []
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert):
            continue
        if any(INJECTED in line for line in lines[node.lineno - 1 : node.end_lineno]):
            continue
        for cmp in ast.walk(node.test):
            if not isinstance(cmp, ast.Compare):
                continue
            operands = [cmp.left, *cmp.comparators]
            for op, a, b in zip(cmp.ops, operands, operands[1:]):
                if not isinstance(op, ORDER):
                    continue
                ka, kb = _kind(a), _kind(b)
                both = ka is not None and kb is not None
                ratio = ("ratio" in (ka, kb)) and (_nonzero_number(a) or _nonzero_number(b))
                if both or ratio:
                    found.append((cmp.lineno, ast.unparse(cmp)))
    return found


def test_no_test_asserts_a_relation_between_measured_times():
    bad = [
        f"{path.name}:{line}: {text}"
        for path in sorted(TESTS.glob("test_*.py"))
        for line, text in timing_asserts(path.read_text())
    ]
    assert not bad, "asserts between measured times (inject the times instead):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "line",
    [
        "assert 0 < off.forward_s < off.seconds",
        "assert r['step_time_s'] > base['step_time_s']",
        "assert time.perf_counter() - t0 < elapsed",
        "assert t_fast < 0.9 * t_slow",
        "assert res['step_time_ratio'] > 1.5",
        "assert p['step_ratio'] < 1.2",
        "assert slow_s / fast_s > 2",
        "assert max(times_a) <= min(times_b)",
    ],
)
def test_the_scan_finds_a_timing_relation(line):
    assert timing_asserts(line), line


@pytest.mark.parametrize(
    "line",
    [
        "assert off.forward_s > 0 and off.seconds > 0",
        "assert time.perf_counter() - t0 < 30",
        "assert res['step_time_ratio'] == spread['median'] > 0",
        "assert spread['min'] <= res['step_time_ratio'] <= spread['max']",
        "assert mb.reserve_s < s.time_budget_s",
        "assert r['bytes'] < base['bytes']",
        "assert t == pytest.approx(plan.predicted_time_s, rel=1e-9)",
        "assert tight.time_s > loose.time_s  # injected times: a synthetic profile",
    ],
)
def test_the_scan_leaves_other_asserts_alone(line):
    assert not timing_asserts(line), line
