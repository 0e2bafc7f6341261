"""How far a gradient is from the exact one: the one measure every report and planner uses.

``1 - cos(got, ref)`` per tensor (parameter or input gradient), in float64, and the worst over a
set of tensors, skipping tensors whose exact gradient is negligible: below ``NEGLIGIBLE`` times
the largest exact gradient norm of the set (a parameter the loss barely reaches has a gradient
made of rounding, whose direction means nothing). A missing gradient where the exact one is not
negligible counts as zeros (error 1); a non-finite one as error 2, the worst a cosine can be.

Users: ``slimact.compare.grad_cosine`` (``slimact memory``'s ``grad_cosine``: one minus the
worst error over the model's parameters), the eager planner's per-storage figures
(``planner/gradstats.py``) and the compiled planner's option and root figures
(``planner/compiled.py``, ``planner/compiled_root.py``).

One step's error is the right yardstick for a deterministic codec (its error is bias); an
unbiased one (PRAC, stochastic rounding) draws fresh noise each step, and the cosine of the mean
over k steps is what says whether training follows (BENCHMARKS.md §4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

NEGLIGIBLE = 1e-6  # an exact gradient below this x the largest of its set is skipped


def one_minus_cos(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``1 - cos(got, ref)`` in float64, in [0, 2]: 0 where both are zero, 1 where exactly one
    is, 2 where ``got`` is not finite."""
    a, b = got.detach().double().flatten(), ref.detach().double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 and nb == 0.0:
        return 0.0
    if not math.isfinite(na):
        return 2.0
    if na == 0.0 or nb == 0.0 or not math.isfinite(nb):
        return 1.0
    return min(2.0, max(0.0, 1.0 - float(a @ b) / (na * nb)))


def grad_errors(
    got: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]
) -> list[float | None]:
    """Per pair, :func:`one_minus_cos` (a missing ``got`` read as zeros), or None where ``ref``
    is missing, zero or negligible (module docstring)."""
    norms = [float(r.detach().double().norm()) if r is not None else 0.0 for r in ref]
    big = max((n for n in norms if math.isfinite(n)), default=0.0)
    out: list[float | None] = []
    for g, r, n in zip(got, ref, norms):
        if r is None or n == 0.0 or n < NEGLIGIBLE * big:
            out.append(None)
        else:
            out.append(one_minus_cos(g if g is not None else torch.zeros_like(r), r))
    return out


def grad_error(got: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]) -> float:
    """The worst :func:`grad_errors` entry (0 where none counts)."""
    return max((e for e in grad_errors(got, ref) if e is not None), default=0.0)


__all__ = ["NEGLIGIBLE", "grad_error", "grad_errors", "one_minus_cos"]
