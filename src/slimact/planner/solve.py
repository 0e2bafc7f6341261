"""``solve_plan(profile, budget)``: the MILP's decisions for a budget, as a ``Plan``.

The budget is a ``slimact.budget.Budget`` (a share of the baseline, or device memory with static
memory counted), the smallest feasible byte count is solved first, so a budget below it is an
error naming that smallest budget, then the time-optimal decision under the budget is solved
and turned into one ``LayerPlan`` per block (``make_plan``): recomputed and reformulated modules,
the codec of each encoded storage with every site that saves it, and one row per storage
(keep / codec:<name> / recompute / offload, in ``slimact.actions``' words) with its bytes before
and after. ``host_budget`` (bytes of pinned host memory, CUDA profiles only) adds offload to the
options (``slimact.planner.offload``); the plan's meta then carries the host bytes it uses.
"""

from __future__ import annotations

from typing import Any

from slimact import actions, spec
from slimact.budget import Budget
from slimact.planner.milp import DEFAULT_MAX_GRAD_ERR, TIE_TOLERANCE, Problem
from slimact.planner.offload import inner_of, is_offload, option_for
from slimact.planner.plan import LayerPlan, Plan, Profile
from slimact.utils import fmt_bytes

__all__ = ["make_plan", "solve_plan"]


def solve_plan(
    profile: Profile,
    budget: str | int | Budget,
    *,
    layers: str = "ends",
    codecs: tuple[str, ...] | None = None,
    recompute: bool = True,
    reform: bool = True,
    max_quality: float | None = None,
    max_rel_err: float | None = None,
    max_grad_err: float | None = DEFAULT_MAX_GRAD_ERR,
    include_static: bool = True,
    host_budget: str | int | None = None,
    link_bandwidth: float | None = None,
) -> Plan:
    """Solve the MILP for ``budget`` (``"25%"``, ``"6GiB"``, an int of bytes) and return the ``Plan``.

    A budget below the smallest feasible one raises ``ValueError`` naming that smallest budget.
    ``max_grad_err`` caps, per block and parameter, the summed measured gradient error of the
    chosen codecs (``slimact.planner.milp``; None: no cap; a profile without figures: no effect).
    ``host_budget``: pinned host memory offload may use ('8GiB'; None: no offload; refused on a
    CPU profile); ``link_bandwidth``: bytes/s (None: measured on the profile's device, once).
    """
    offload = option_for(profile.device, host_budget, link_bandwidth)
    problem = Problem(
        profile, layers, codecs, recompute, reform, max_rel_err, max_grad_err, offload
    )
    base = profile.baseline_bytes
    budget = spec.parse_budget(budget)
    static = profile.static.get("total", 0) if include_static and not budget.relative else 0
    allowed = budget.allowed(base, static)
    smallest = problem.min_bytes(max_quality)
    if smallest.status == "infeasible":
        raise ValueError(f"no plan satisfies max_quality={max_quality}; raise it or drop the cap")
    if allowed < smallest.bytes:
        extra = f" = {fmt_bytes(smallest.bytes + static)} of device memory" if static else ""
        raise ValueError(
            f"budget {str(budget)!r} allows {fmt_bytes(max(allowed, 0))} of activations "
            f"({allowed / base:.1%} of the baseline {fmt_bytes(base)}); the smallest feasible "
            f"budget is {fmt_bytes(smallest.bytes)} ({smallest.bytes / base:.1%}){extra} for "
            f"{profile.model} at batch {profile.batch} x seq {profile.seq}"
        )
    res = problem.solve(allowed, max_quality, tie_tolerance=TIE_TOLERANCE)
    if res.status == "infeasible" or res.bytes > allowed:  # solver tolerance: the exact floor
        res = smallest
    return make_plan(problem, res, budget, allowed, static, smallest.bytes)


def make_plan(
    problem: Any, res: Any, budget: Budget, allowed: int, static: int, floor: int
) -> Plan:
    prof = problem.profile
    layers = []
    for g, d in zip(problem.groups, res.decisions):
        kind = g.kind
        drop = problem.dropped(g, d)
        by_codec: dict[str, list[str]] = {}
        for sid, c in sorted(d.codecs.items()):
            s = kind.storages[sid]
            names = [x for x in s.sites if x != "!extern"]
            for m in kind.modules:
                if m.path in d.recompute and sid in m.inputs:
                    names += [
                        f"{m.path}:checkpoint_input#{j}" for j, i in enumerate(m.inputs) if i == sid
                    ]
            for r in kind.reforms:
                if r.path in d.reform:
                    names += r.saver_sites.get(str(sid), [])
            by_codec.setdefault(c, []).extend(names)
        t = sum(m.recompute_s for m in kind.modules if m.path in d.recompute)
        t += sum(max(r.delta_s, 0.0) for r in kind.reforms if r.path in d.reform)
        coded = [(sid, inner_of(c) if is_offload(c) else c) for sid, c in d.codecs.items()]
        t += sum(kind.storages[sid].codecs[c].encode_s + kind.storages[sid].codecs[c].decode_s
                 for sid, c in coded if c != "raw")  # fmt: skip
        if hasattr(problem, "stall_s"):
            t += problem.stall_s(g, d) / len(g.blocks)
        extra = sum(r.extra_bytes for r in kind.reforms if r.path in d.reform)
        for b in g.blocks:
            rows = []
            for s in kind.storages:
                raw = kind.bytes_of(b, s.id, "raw")
                if s.id in drop:
                    act, after = actions.RECOMPUTE, 0
                elif s.id in d.codecs:
                    c = d.codecs[s.id]
                    act, after = actions.codec(c), kind.bytes_of(b, s.id, c)
                else:
                    act, after = actions.KEEP, raw  # a checkpoint's input too
                if s.sites or after:
                    rows.append((s.name, act, raw if s.sites else 0, after))
            layers.append(
                LayerPlan(
                    block=b,
                    kind=kind.kind,
                    recompute=tuple(sorted(d.recompute)),
                    reform=tuple(sorted(d.reform)),
                    codecs=tuple((c, tuple(v)) for c, v in sorted(by_codec.items())),
                    storages=tuple(rows),
                    baseline_bytes=sum(r[2] for r in rows),
                    predicted_bytes=sum(r[3] for r in rows) + extra,
                    predicted_time_s=t,
                    reform_kinds=tuple(
                        (r.path, r.kind) for r in kind.reforms if r.path in d.reform
                    ),
                )  # fmt: skip
            )
    return Plan(
        model=prof.model, batch=prof.batch, seq=prof.seq, dtype=prof.dtype, budget=str(budget),
        budget_bytes=int(allowed), baseline_bytes=prof.baseline_bytes, static_bytes=static,
        predicted_bytes=int(res.bytes), predicted_time_s=res.time_s, min_feasible_bytes=floor,
        solve_s=res.solve_s, layers=tuple(layers),
        meta=(("status", res.status), ("quality", res.quality), ("device", prof.device),
              ("grad_err", getattr(res, "grad_err", 0.0)),
              ("max_grad_err", getattr(problem, "max_grad_err", None)),
              ("autocast", prof.meta.get("autocast")), ("profile_s", prof.meta.get("profile_s")))
        + (_offload_meta(problem, res) if getattr(problem, "offload", None) else ())
        + ((("tie_break", res.tie_break),) if getattr(res, "tie_break", "") else ())
        + ((("grad_err_skipped", prof.meta["grad_err_skipped"]),)
           if "grad_err_skipped" in prof.meta else ()),
    )  # fmt: skip


def _offload_meta(problem: Any, res: Any) -> tuple:
    off = problem.offload
    return (("host_bytes", problem.host_bytes(res.decisions)),
            ("host_budget", off.host_budget), ("link_bandwidth", off.bandwidth))  # fmt: skip
