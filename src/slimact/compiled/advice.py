"""Whether the chosen strategy is dominated on this device, and by what: one line for the user.

A point is *dominated* when another keeps no more memory and runs faster. On a CPU the eager
actions were tuned and win; on a GPU the eager codec policies (``int4``, ``int8``, ``prac``,
``auto`` and their ablations) pay per-tensor Python work and host syncs that a short GPU step
cannot hide, while compiled blocks recompute nearly for free. Two sources, the measured one
first:

* :func:`measured_dominance`: the strategy and its rivals measured in the same run (``slimact
  memory --compare-compiled``, ``slimact bench``): the fastest rival whose peak (on CUDA, what
  decides whether a run fits; else the saved bytes) is no larger and whose step is shorter;
* :func:`documented_dominance`: without a measurement, the rule the GPU runs documented
  (:data:`CUDA_EVIDENCE`, BENCHMARKS.md's GPU section), named with its evidence. It covers the
  eager codec policies on CUDA; an ``auto`` budget below the bytes the dominating point keeps is
  not covered (that point does not keep fewer bytes there).

:func:`compiled_rivals` names what ``--compare-compiled`` measures: the strategy's own
``compile=True`` form and ``compiled-recompute``.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimact import spec
from slimact.registry import COMPILED_PREFIX, codec_policy_names, compiled_form_of, compiled_spec
from slimact.utils import fmt_bytes


@dataclass(frozen=True)
class Evidence:
    """A measured comparison on one device: ``rows`` maps a point to (saved bytes, peak, step
    time), each a ratio to eager ``none`` on the same weights and batch."""

    source: str
    setup: str
    rows: dict[str, tuple[float, float, float]]
    faster: str  # the point that dominates the eager codec policies there
    how: str  # how to run ``faster``


CUDA_EVIDENCE = Evidence(
    source="BENCHMARKS.md §8",
    setup="H200, llama-20m, bf16 weights, 16 x 512",
    rows={
        "int4": (0.397, 0.467, 7.99),
        "auto@25%": (0.241, 0.323, 2.28),
        "compiled-recompute": (0.078, 0.178, 0.77),
    },
    faster="compiled-recompute",
    how="--strategy recompute --compile",
)


def _eager_codec_parts(strategy: str) -> list[spec.Part]:
    # offload's policy moves block inputs to the host: the evidence (codecs' time) is not its
    policies = codec_policy_names() - {"plan", "offload"}
    return [
        p
        for p in spec.parse(strategy)
        if p.name in policies and not p.name.startswith(COMPILED_PREFIX)
    ]


def documented_dominance(strategy: str, device_type: str) -> str | None:
    """One line when ``strategy`` is an eager codec policy on CUDA, naming the point that keeps
    fewer bytes faster there and the measurement behind it (module docstring); else None."""
    if device_type != "cuda":
        return None
    parts = _eager_codec_parts(strategy)
    if not parts:
        return None
    ev = CUDA_EVIDENCE
    kept = ev.rows[ev.faster][0]
    for p in parts:
        if p.name == "auto" and (
            p.budget is None or p.budget.share is None or p.budget.share < kept
        ):
            return None  # fewer bytes than the evidence's point keeps: not covered
    eager = [k for k in ev.rows if not k.startswith(COMPILED_PREFIX)]
    names = {p.name for p in parts}
    shown = [k for k in eager if spec.parse_part(k).name in names] or eager
    measured = " and ".join(
        f"eager {k} took {ev.rows[k][2]:.2f}x (peak {ev.rows[k][1]:.3f})" for k in shown
    )
    _, peak, t = ev.rows[ev.faster]
    return (
        f"warning: eager {strategy} is likely dominated on CUDA: {ev.faster} ({ev.how}) peaked "
        f"at {peak:.3f} of eager none's peak in {t:.2f}x its step, where {measured} "
        f"({ev.setup}; {ev.source}); --compare-compiled measures both here"
    )


def measured_dominance(
    strategy: dict, rivals: list[dict], device_type: str, how: dict[str, str] | None = None
) -> str | None:
    """One line naming the fastest of ``rivals`` that dominates ``strategy`` in this run, else
    None. Records carry ``strategy``, ``peak_bytes``, ``saved_bytes`` and ``step_time_s`` (a
    rival without them, e.g. one that failed, is ignored); on CUDA the peak is compared, elsewhere
    the saved bytes. ``how``: how to run each rival (e.g. ``--compile``)."""
    key, what = ("peak_bytes", "peaks at") if device_type == "cuda" else ("saved_bytes", "saves")
    mine, t = strategy.get(key), strategy.get("step_time_s")
    if mine is None or not t:
        return None
    better = [
        r
        for r in rivals
        if r.get(key) is not None
        and r.get("step_time_s") is not None
        and r[key] <= mine
        and r["step_time_s"] < t
    ]
    if not better:
        return None
    best = min(better, key=lambda r: r["step_time_s"])
    run = f" ({how[best['strategy']]})" if how and best["strategy"] in how else ""
    return (
        f"warning: {strategy['strategy']} is dominated on this device ({device_type}): "
        f"{best['strategy']}{run} {what} {fmt_bytes(best[key])} (vs {fmt_bytes(mine)}) in "
        f"{best['step_time_s'] / t:.2f}x its step, measured in this run"
    )


def compiled_rivals(strategy: str) -> list[str]:
    """What ``--compare-compiled`` measures beside ``strategy``: its ``compile=True`` form (if it
    has one) and ``compiled-recompute``, less ``strategy`` itself."""
    out = []
    try:
        out.append(compiled_spec(strategy))
    except ValueError:
        pass
    out.append(compiled_form_of("recompute") or "compiled-recompute")
    return [r for r in dict.fromkeys(out) if r != strategy]
