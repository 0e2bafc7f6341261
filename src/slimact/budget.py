"""Memory budgets, parsed once at the edge: ``Budget.parse("25%")``, ``Budget.parse("6GiB")``.

A budget is either a **share** of the baseline activation bytes (``"25%"``: what strategy
``none`` saves, as the meter counts it) or an absolute **device-memory** size (``"6GiB"``,
``"512MB"``, ``"123456B"``, or a Python ``int`` of bytes), static memory (parameters, gradients,
optimizer states) included, as adacc.txt Eq. 7 has it. A bare number in a string (``"25"``) is
refused: it reads as 25 % as easily as 25 bytes.

``Budget`` is typed and frozen; ``str(budget)`` is its canonical text, which ``Budget.parse``
reads back to an equal budget (an int of bytes prints as ``"<n>B"``), so plans and checkpoints
store the text. ``budget.allowed(baseline, static)`` is the activation bytes it allows.
``add_budget_argument(parser)`` is the one ``--budget`` flag of every command line.
:class:`BudgetWarning` is the one warning a plan's measured bytes over its budget raise (eager
``auto``'s first-step check, the compiled planner's verification).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_BUDGET = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)


# argparse's negative numbers (``-5``, ``-.5``) and negative budgets (``-5%``, ``-2GiB``)
_NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d*\.?\d+(?:e[+-]?\d+)?\s*[a-z%]+$", re.IGNORECASE)


class BudgetWarning(RuntimeWarning):
    """A planned model's measured stored bytes exceed its budget (the message names the budget,
    the bytes and the gap)."""


@dataclass(frozen=True)
class Budget:
    """``share`` in (0, 1] of the baseline activation bytes, or ``total`` bytes of device
    memory; ``text`` is how it was written (canonical for ints: ``"<n>B"``)."""

    text: str
    share: float | None = None
    total: int | None = None

    def __post_init__(self) -> None:
        if (self.share is None) == (self.total is None):
            raise ValueError(f"a Budget is a share or a total, got {self!r}")
        share, total = self.share, self.total
        if share is not None and not (isinstance(share, float | int) and 0 < share <= 1):
            raise ValueError(
                f"budget {self.text!r}: a share of the baseline is in (0, 1] (0% to 100%, 0 "
                f"excluded), got {share!r}"
            )
        if total is not None and not (isinstance(total, int) and total > 0):
            raise ValueError(f"budget {self.text!r}: a size in bytes is > 0, got {total!r}")

    @classmethod
    def parse(cls, value: str | int | Budget) -> Budget:
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ValueError(
                f"budget must be like '25%' or '6GiB' (or an int of bytes), got {value!r}"
            )
        if isinstance(value, int):
            number, unit, text = float(value), "b", f"{value}B"
        else:
            m = _BUDGET.match(value)
            if m and not m.group(2):
                raise ValueError(
                    f"budget {value!r} has no unit: use '{m.group(1)}%' of the baseline or a "
                    f"size such as '{m.group(1)}MiB' / '6GiB'"
                )
            if not m or m.group(2).lower() not in (*_UNITS, "%"):
                raise ValueError(
                    f"budget {value!r} is not understood; use a percentage of the baseline "
                    f"activation memory ('25%') or a size ('6GiB', '512MB', '123456B')"
                )
            number, unit, text = float(m.group(1)), m.group(2).lower(), value.strip()
        if unit == "%":
            if not 0 < number <= 100:
                raise ValueError(f"budget percentage must be in (0, 100], got {value!r}")
            return cls(text, share=number / 100)
        size = number * _UNITS[unit]
        if not math.isfinite(size):
            raise ValueError(f"budget {value!r} is too large to be a size in bytes")
        total = int(size)
        if total <= 0:
            raise ValueError(f"budget must be > 0, got {value!r}")
        return cls(text, total=total)

    @property
    def relative(self) -> bool:
        """A share of the baseline (so it moves with the batch shape and dtype)."""
        return self.share is not None

    def allowed(self, baseline_bytes: int, static_bytes: int = 0) -> int:
        """Activation bytes the budget allows (device memory minus ``static_bytes``)."""
        if self.share is not None:
            return int(baseline_bytes * self.share)
        return int(self.total or 0) - static_bytes

    def __str__(self) -> str:
        return self.text


def _argparse_budget(text: str) -> Budget:
    try:
        return Budget.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_budget_argument(
    parser: argparse.ArgumentParser, *, required: bool = False, what: str = "strategy 'auto'"
) -> None:
    """The ``--budget`` flag: parsed to a ``Budget`` by argparse (a bad one is a usage error
    naming the value). A negative budget (``--budget -5%``) reaches ``Budget.parse``'s own
    message: argparse would take it for an unknown option (it reads only plain negative
    numbers as values), so ``parser`` reads negative sizes and shares as values too."""
    if hasattr(parser, "_negative_number_matcher"):  # argparse's own test of such values
        parser._negative_number_matcher = _NEGATIVE
    parser.add_argument(
        "--budget",
        type=_argparse_budget,
        required=required,
        default=None,
        help=f"memory budget for {what}: a share of the baseline activations ('25%%') or "
        "device memory ('6GiB', '512MB', '123456B')",
    )
