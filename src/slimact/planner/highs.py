"""The MILP of ``slimact.planner.milp`` as HiGHS sees it: binary columns, sparse rows, one call.

``milp.py`` states the rules (its docstring) and evaluates a decision exactly; this module is
their linearization. :func:`build` gives each decision variable of a ``milp.Problem`` one column,
keyed ``(group index, kind, key)``:

    r  recompute module ``key``        z  reformulate module ``key``
    k  keep storage ``key``            y  store storage ``key[0]`` through codec ``key[1]``
    d  storage ``key`` is dropped       w  codec ``key[1]`` on ``key[0]`` feeds the re-run of a
                                          recomputed module ``key[2]`` (gradient cap only)
    u, v  the group's offload stall beyond one block's forward / two (continuous, >= 0; only
          where offload is an option: ``slimact.planner.offload``)

and writes every constraint row of the docstring but the budget's, with the per-column bytes,
added seconds and quality cost. :func:`run` adds the budget (and quality) rows and the
objective, scales bytes to MiB and seconds to ms so HiGHS' tolerances mean something, and
solves; ``Problem.solve`` reads the chosen columns back into decisions.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from slimact.planner.offload import inner_of, is_offload
from slimact.planner.plan import inside, site_module

EPS_S = 1e-9  # seconds per recompute/reformulation: ties go towards doing nothing
SCALE = 2.0**20  # bytes in MiB


class Rows(NamedTuple):
    cols: list[tuple]  # (group index, kind, key) per column
    index: dict[tuple, int]  # the inverse of cols
    rows: list[dict[int, float]]  # constraint rows: column -> coefficient
    lo: list[float]
    hi: list[float]
    mem: dict[int, float]  # column -> activation bytes
    obj: dict[int, float]  # column -> added seconds per step
    qual: dict[int, float]  # column -> quality cost (relative MSE)
    cont: frozenset[int] = frozenset()  # continuous columns (>= 0, unbounded): the rest binary
    counts: dict[int, float] | None = None  # integer columns with this upper bound (not binary)


def build(problem) -> Rows:
    """The columns, constraint rows and objective/memory/quality coefficients of ``problem``
    (a ``milp.Problem``), without the budget row (added per solve)."""
    cols: list[tuple] = []  # (group index, kind, key)
    index: dict[tuple, int] = {}

    def var(gi: int, kind: str, key) -> int:
        k = (gi, kind, key)
        if k not in index:
            index[k] = len(cols)
            cols.append(k)
        return index[k]

    rows: list[dict[int, float]] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(coefs: dict[int, float], lb: float, ub: float) -> None:
        rows.append(coefs)
        lo.append(lb)
        hi.append(ub)

    mem: dict[int, float] = {}
    obj: dict[int, float] = {}
    qual: dict[int, float] = {}
    cont: set[int] = set()
    host: dict[int, float] = {}  # offload column -> host bytes
    for gi, g in enumerate(problem.groups):
        kind, n = g.kind, len(g.blocks)
        cand = problem.candidates(g)
        cvar = [var(gi, t, p) for t, p in cand]
        for va in cvar:
            obj[va] = n * EPS_S
        for i in g.rc:
            m = kind.modules[i]
            obj[index[(gi, "r", m.path)]] += n * m.recompute_s
        for i in g.rf:
            r = kind.reforms[i]
            v = index[(gi, "z", r.path)]
            obj[v] += n * max(r.delta_s, 0.0)
            mem[v] = mem.get(v, 0.0) + n * r.extra_bytes
        for a in range(len(cand)):
            for b in range(a + 1, len(cand)):
                pa, pb = cand[a][1], cand[b][1]
                if inside(pa, pb) or inside(pb, pa):
                    row({cvar[a]: 1, cvar[b]: 1}, -np.inf, 1)
        grad_rows: dict[str, dict[int, float]] = {}
        for s in kind.storages:
            kv, dv = var(gi, "k", s.id), var(gi, "d", s.id)
            one = {kv: 1.0, dv: 1.0}
            mem[kv] = float(problem.bytes_of(g, s.id, "raw"))
            for c in g.options[s.id][1:]:
                yv = var(gi, "y", (s.id, c))
                one[yv] = 1.0
                mem[yv] = float(problem.bytes_of(g, s.id, c))
                obj[yv] = problem.time_of(g, s.id, c)
                qual[yv] = problem.quality_of(g, s.id, c)
                for k, e in problem.grad_terms(g, s.id, c).items():
                    if e > 0:
                        grad_rows.setdefault(k, {})[yv] = e
                for i in g.rc if problem.max_grad_err is not None else ():
                    m = kind.modules[i]
                    extra = problem.ckpt_terms(g, s.id, c, m.path) if s.id in m.inputs else {}
                    rv = index[(gi, "r", m.path)]
                    if extra is None:  # the pair was left unmeasured: not both
                        row({yv: 1.0, rv: 1.0}, -np.inf, 1)
                    elif extra:  # w >= y_sc + r_m - 1: the codec feeds m's re-run
                        wv = var(gi, "w", (s.id, c, m.path))
                        row({wv: 1.0, yv: -1.0, rv: -1.0}, -1, np.inf)
                        for k, e in extra.items():
                            grad_rows.setdefault(k, {})[wv] = e
            row(one, 1, 1)
            sil = []
            for p in s.sites:
                terms = {}
                if p != "!extern":
                    for i in g.rc:
                        if inside(site_module(p), kind.modules[i].path):
                            terms[index[(gi, "r", kind.modules[i].path)]] = 1.0
                    for i in g.rf:
                        if p in kind.reforms[i].silenced:
                            terms[index[(gi, "z", kind.reforms[i].path)]] = 1.0
                sil.append(terms)
                row({dv: 1.0, **{v: -1.0 for v in terms}}, -np.inf, 0)
            holders = [index[(gi, "r", kind.modules[i].path)] for i in g.rc
                       if s.id in kind.modules[i].inputs]  # fmt: skip
            holders += [index[(gi, "z", kind.reforms[i].path)] for i in g.rf
                        if s.id in kind.reforms[i].added]  # fmt: skip
            for h in holders:
                row({dv: 1.0, h: 1.0}, -np.inf, 1)
            lower: dict[int, float] = {dv: 1.0}
            for terms in sil:
                for v in terms:
                    lower[v] = lower.get(v, 0.0) - 1.0
            for h in holders:
                lower[h] = lower.get(h, 0.0) + 1.0
            row(lower, 1 - len(s.sites), np.inf)
        if problem.max_grad_err is not None:
            for coefs in grad_rows.values():  # one row per parameter (and the input)
                if sum(coefs.values()) > problem.max_grad_err:
                    row(coefs, -np.inf, problem.max_grad_err)
        off = {index[(gi, "y", (s.id, o))]: (s.id, o) for s in kind.storages
               for o in g.options[s.id] if is_offload(o)}  # fmt: skip
        if off:  # in ms: u >= C - T_f, v >= C - 2 T_f (C: the offloaded copies' seconds)
            t_f = problem.hide_s(g)
            copies = {y: 1e3 * problem.copy_s(g, sid, o) for y, (sid, o) in off.items()}
            for name, window in (("u", t_f), ("v", 2 * t_f)):
                sv = var(gi, name, 0)
                cont.add(sv)
                obj[sv] = float(n)
                row({sv: 1e3, **{y: -c for y, c in copies.items()}}, -1e3 * window, np.inf)
            for y, (sid, o) in off.items():
                host[y] = float(problem.bytes_of(g, sid, inner_of(o)))
    if host:  # the pinned host memory the offloaded storages take, in MiB
        row({y: b / SCALE for y, b in host.items()}, -np.inf, problem.offload.host_budget / SCALE)
    return Rows(cols, index, rows, lo, hi, mem, obj, qual, frozenset(cont))


def run(
    built: Rows,
    budget_bytes: float | None,
    max_quality: float | None = None,
    minimize: str = "time",
    time_limit: float = 60.0,
    tie_tolerance: float = 0.0,
):
    """Solve ``built`` (not changed): minimize added time s.t. bytes <= ``budget_bytes``, or
    minimize bytes (then time, as a tie-break). Returns scipy's ``OptimizeResult``; its ``x``
    is None when infeasible.

    ``tie_tolerance`` (minimizing time): plans within this share of the fastest plan's seconds
    are near ties, which measurement noise would otherwise decide; among them the plan taken is
    the one with the fewest lossy choices (columns of a quality cost), then the fewest bytes,
    then the least time, each a solve of its own (``near_tie``); ``x`` is that plan's and
    ``tie_break`` says what decided."""
    res = _run(built, budget_bytes, max_quality, minimize, time_limit)
    if minimize != "time" or not tie_tolerance > 0 or res.x is None:
        return res
    return near_tie(built, budget_bytes, max_quality, res, tie_tolerance, time_limit)


def near_tie(built: Rows, budget_bytes, max_quality, res, tolerance: float, time_limit: float):
    """Among the plans of ``built`` within ``tolerance`` of ``res``'s seconds (the fastest),
    the fewest lossy choices, then the fewest bytes (``run``'s docstring)."""
    n = len(built.cols)
    fastest = sum(built.obj.get(j, 0.0) * float(res.x[j]) for j in range(n))
    cap = fastest * (1.0 + tolerance) + 1e-12
    lossy = {j: 1.0 for j, q in built.qual.items() if q > 0}
    band = built._replace(
        rows=[*built.rows, dict(built.obj)], lo=[*built.lo, -np.inf], hi=[*built.hi, cap]
    )
    exact = _run(band._replace(obj=lossy), budget_bytes, max_quality, "time", time_limit)
    if exact.x is None:
        return res
    fewest = float(round(sum(float(exact.x[j]) for j in lossy)))
    lean_rows = band._replace(
        rows=[*band.rows, lossy], lo=[*band.lo, -np.inf], hi=[*band.hi, fewest + 0.5]
    )
    lean = _run(lean_rows, budget_bytes, max_quality, "bytes", time_limit)
    if lean.x is not None:  # the fastest of the leanest: no time spent that saves no byte
        least = sum(c * float(lean.x[v]) for v, c in built.mem.items()) / SCALE
        mib = {v: c / SCALE for v, c in built.mem.items()}
        fast = lean_rows._replace(rows=[*lean_rows.rows, mib], lo=[*lean_rows.lo, -np.inf],
                                  hi=[*lean_rows.hi, least + 1e-6])  # fmt: skip
        again = _run(fast, budget_bytes, max_quality, "time", time_limit)
        lean = again if again.x is not None else lean
    out = lean if lean.x is not None else exact
    out.tie_break = (
        f"plans within {tolerance:.0%} of the fastest plan's seconds taken as equally fast: "
        f"the fewest lossy choices ({int(fewest)}), then the fewest bytes"
    )
    return out


def _run(
    built: Rows,
    budget_bytes: float | None,
    max_quality: float | None,
    minimize: str,
    time_limit: float,
):
    cols, rows, lo, hi, mem, obj, qual = (
        built.cols,
        built.rows,
        built.lo,
        built.hi,
        built.mem,
        built.obj,
        built.qual,
    )
    rows, lo, hi = list(rows), list(lo), list(hi)
    n = len(cols)
    if budget_bytes is not None:
        rows.append({v: c / SCALE for v, c in mem.items()})
        lo.append(-np.inf)
        hi.append(budget_bytes / SCALE)
    if max_quality is not None:
        rows.append(dict(qual))
        lo.append(-np.inf)
        hi.append(max_quality)
    c = np.zeros(n)
    src = obj if minimize == "time" else mem
    for v, x in src.items():
        c[v] = x * (1e3 if minimize == "time" else 1 / SCALE)
    if minimize != "time":
        for v, x in obj.items():
            c[v] += x * 1e-6  # among the smallest plans, the fastest
    ri, ci, vals = [], [], []
    for i, r in enumerate(rows):
        for v, x in r.items():
            ri.append(i)
            ci.append(v)
            vals.append(x)
    a = coo_matrix((vals, (ri, ci)), shape=(len(rows), n)).tocsr()
    integrality, upper = np.ones(n), np.ones(n)
    for v in built.cont:
        integrality[v], upper[v] = 0, np.inf
    for v, most in (built.counts or {}).items():
        upper[v] = most
    # disp=False turns HiGHS' output off (its own option): a solve prints nothing and changes
    # no file descriptor, so solves on several threads at once leave the process's stdout alone
    return milp(
        c,
        constraints=LinearConstraint(a, np.array(lo), np.array(hi)),
        integrality=integrality,
        bounds=Bounds(0, upper),
        options={"time_limit": time_limit, "mip_rel_gap": 1e-9, "disp": False},
    )


__all__ = ["EPS_S", "Rows", "build", "run"]
