"""The MILP: one action per stored tensor, minimum added step time under a memory budget.

adacc.txt §3.3 (Eqs. 4-8) gives each tensor one of {recompute, compress, keep}. Here the
decisions are finer and cover every action slimact has. For a *group* g of blocks that share a
plan (one block, or every block of a kind: ``layers='uniform'`` is Adacc's "all layers
identical"), with binaries

    r_A    recompute module A (non-reentrant checkpoint of A's forward)
    z_m    reformulate module m (invact: save the output + a bit mask / rstd instead of x)
    k_s    keep storage s as is;   y_sc  store s through codec c;   d_s  s is not stored at all

the constraints are

    k_s + Σ_c y_sc + d_s = 1                                   one action per storage    (Eq. 5)
    x_a + x_b <= 1        for nested candidates a ⊂ b          (no checkpoint inside a checkpoint)
    sil(p) = Σ_{A ∋ p} r_A + Σ_{m silences p} z_m              is saver site p silenced?
    d_s <= sil(p)                 for every saver p of s       dropped only if no one saves it
    d_s <= 1 - r_A                for A with input s           a checkpoint keeps its inputs
    d_s <= 1 - z_m                for m whose inverted op saves s (its output)
    d_s >= Σ_p sil(p) - (|P_s| - 1) - Σ_A r_A - Σ_m z_m        ... and is dropped once it can be

The last line makes ``d`` exact (a storage nobody saves *is* freed), so predictions are the
bytes the meter will see. "A recomputed site needs its inputs available" is the third line:
inputs of a checkpointed module stay stored, kept or through a codec (the checkpoint's input
save goes through the codec policy like any other save), and the block input is never
recomputed (no candidate produces it). Memory (Eqs. 7-8, one term per block, per-block bytes
from the profile) and the objective (Eq. 4, plus the measured slowdown of reformulated ops):

    static + Σ_g Σ_{b∈g} [Σ_s (B_bs k_s + Σ_c B_bsc y_sc) + Σ_m E_m z_m] <= budget
    min  Σ_g |g| [Σ_A T_A r_A + Σ_sc (Tenc_sc + Tdec_sc) y_sc + Σ_m max(ΔT_m, 0) z_m]
    optional:  Σ_g |g| Σ_sc err_sc² y_sc <= max_quality        (sum of relative MSEs)
    optional:  Σ_sc G_scP y_sc + Σ_scA H_scAP w_scA <= max_grad_err   for every group g and
               parameter P of its block,  w_scA >= y_sc + r_A - 1  (s an input of A)
    optional:  offload as one more "codec" of every block storage (0 device bytes, lossless),
               and offload+c for each codec c it admits (c's payload moved: c's time, error):
               Σ_g |g| Σ_s B_s y_s,off <= host_budget, and the copies' stall in the objective,
               |g| (u_g + v_g) with u_g >= Σ_s B_s/bw y_s,off - T_f, v_g >= ... - 2 T_f,
               u, v >= 0 continuous (``slimact.planner.offload``: bandwidth, windows)

``G_scP`` is the measured gradient error (``slimact.planner.gradstats``: 1 - cosine of parameter
``P``'s gradient, or of the block's input gradient, with storage s alone through codec c, on the
profiling batch's real upstream gradient): the training-aware quality model. 1 - cos of small
independent errors adds up, so the row bounds each parameter's cosine in each block, which is
what ``grad_cosine`` (the minimum over parameters) sees. ``H_scAP`` is what recomputing A from
codec c's copy of its input s adds (measured jointly: the re-run's saves all derive from the
copy). A candidate without a figure (a
shapes-only or old profile, a storage only a checkpoint stores) is bounded by ``max_rel_err``
alone; one the profiler found too lossy to measure (``None``: ``gradstats.MEASURED_REL_ERR``)
is out.

A 1e-9 s cost per recompute/reformulation breaks ties towards doing nothing. Linearized and
solved by HiGHS through ``scipy.optimize.milp`` in ``slimact.planner.highs``. ``evaluate`` computes bytes and time of a decision directly
from these rules (no linearization), and ``brute_force`` enumerates decisions for small groups:
the optimality test checks the MILP against it.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from slimact.planner import highs
from slimact.planner.offload import OFFLOAD, OffloadOption, inner_of, is_offload, stall_s
from slimact.planner.plan import (
    ROOT,
    KindProfile,
    Profile,
    StorageProfile,
    inside,
    site_module,
)

__all__ = [
    "DEFAULT_MAX_GRAD_ERR",
    "TIE_TOLERANCE",
    "GRAD_CKPT_KEY",
    "GRAD_KEY",
    "LAYER_MODES",
    "Decision",
    "Problem",
    "Result",
    "brute_force",
]

LAYER_MODES = ("uniform", "ends", "each")
GRAD_KEY = "grad_err"  # Profile.meta key of the measured gradient errors (planner.gradstats)
GRAD_CKPT_KEY = "grad_err_recompute"  # the same for a codec on a recomputed module's input
# per block and parameter, the summed 1 - cos the chosen codecs cost the gradient (the cap's
# calibration: BENCHMARKS.md §6, auto's quality)
DEFAULT_MAX_GRAD_ERR = 2e-3


@dataclass
class Group:
    """Blocks of one kind that share decisions, and the options of each decision."""

    kind: KindProfile
    blocks: list[str]
    rc: list[int]  # indices into kind.modules (recompute candidates)
    rf: list[int]  # indices into kind.reforms
    options: dict[int, list[str]]  # storage id -> ["raw", codec, ...]


@dataclass
class Decision:
    recompute: frozenset[str] = frozenset()
    reform: frozenset[str] = frozenset()
    codecs: dict[int, str] = field(default_factory=dict)  # storage id -> codec


@dataclass
class Result:
    decisions: list[Decision]
    bytes: int
    time_s: float
    quality: float
    status: str
    solve_s: float
    grad_err: float = 0.0  # the largest summed gradient error of one parameter (grad_load)
    tie_break: str = ""  # how near ties were decided (``highs.run``'s ``tie_tolerance``)


# plans whose added seconds are within this share of the fastest plan's are near ties, decided
# by a fixed order (exact before lossy, then fewer bytes: ``highs.near_tie``), not by the noise
# of the measured times (``solve_plan``; ``Problem.solve`` solves exactly unless asked)
TIE_TOLERANCE = 0.03

SLOT_FROM = 5  # identical blocks of one kind, from this many on, share decisions in slots


def slot_sizes(n: int) -> list[int]:
    """Sizes 1, 1, 2, 4, ... (each at most the sum before it, the last one the rest) summing to
    ``n``: every count 0..n is the sum of some of them, so any split of ``n`` identical blocks
    between two decisions is one assignment of decisions to slots."""
    sizes, total = [], 0
    while total < n:
        size = min(max(total, 1), n - total)
        sizes.append(size)
        total += size
    return sizes


def each_parts(kind: KindProfile) -> list[list[str]]:
    """``layers='each'``: one group per block, except that blocks with identical per-block bytes
    (a shapes-only profile's, a replicated one's) are interchangeable: from ``SLOT_FROM`` of them
    on they are grouped into ``slot_sizes`` slots (32 blocks: 6 groups of 1, 1, 2, 4, 8, 16
    instead of 32), which keeps every plan mixing two decisions over them and cuts the solver's
    symmetric search (llama-7b's 32 blocks: seconds -> a fraction)."""
    classes: dict[str, list[str]] = {}
    for b in kind.blocks:
        classes.setdefault(repr(sorted(kind.per_block.get(b, {}).items())), []).append(b)
    parts = []
    for members in classes.values():
        if len(members) < SLOT_FROM:
            parts.extend([b] for b in members)
            continue
        at = 0
        for size in slot_sizes(len(members)):
            parts.append(members[at : at + size])
            at += size
    return sorted(parts, key=lambda p: kind.blocks.index(p[0]))


class Problem:
    """The planning problem for a profile: groups of blocks with their candidate actions."""

    def __init__(
        self,
        profile: Profile,
        layers: str = "ends",
        codecs: tuple[str, ...] | None = None,
        recompute: bool = True,
        reform: bool = True,
        max_rel_err: float | None = None,
        max_grad_err: float | None = None,
        offload: OffloadOption | None = None,
    ) -> None:
        if layers not in LAYER_MODES:
            raise ValueError(f"layers must be one of {LAYER_MODES}, got {layers!r}")
        self.profile = profile
        self.grad: dict = profile.meta.get(GRAD_KEY) or {}
        self.grad_ckpt: dict = profile.meta.get(GRAD_CKPT_KEY) or {}
        self.max_grad_err = max_grad_err
        self.offload = offload
        self.groups: list[Group] = []
        for kind in profile.kinds:
            b = kind.blocks
            if kind.kind == ROOT:
                parts = [[x] for x in b]
            elif layers == "each":
                parts = each_parts(kind)
            elif layers == "ends" and len(b) > 2:
                parts = [[b[0]], b[1:-1], [b[-1]]]
            elif layers == "ends":
                parts = [[x] for x in b]
            else:
                parts = [list(b)]
            for blocks in parts:
                opts = {}
                for s in kind.storages:
                    ok = [
                        c
                        for c, st in s.codecs.items()
                        if (codecs is None or c in codecs)
                        and (max_rel_err is None or st.rel_err <= max_rel_err)
                        and self._grad_ok(kind.kind, s, c)
                    ]
                    opts[s.id] = ["raw", *ok]
                    if offload is not None and kind.kind != ROOT and s.bytes > 0:
                        if "!extern" not in s.sites:  # the tensor, or a codec's payload
                            opts[s.id] += [OFFLOAD, *(f"{OFFLOAD}+{c}" for c in ok)]
                rc = list(range(len(kind.modules))) if recompute else []
                rf = list(range(len(kind.reforms))) if reform else []
                self.groups.append(Group(kind, blocks, rc, rf, opts))

    # -- coefficients ------------------------------------------------------------------------
    @staticmethod
    def bytes_of(g: Group, sid: int, opt: str) -> int:
        return sum(g.kind.bytes_of(b, sid, opt) for b in g.blocks)

    @staticmethod
    def time_of(g: Group, sid: int, opt: str) -> float:
        """Encode + decode seconds (offload's copies are charged per group: ``stall_s``)."""
        opt = inner_of(opt) if is_offload(opt) else opt
        if opt == "raw":
            return 0.0
        st = g.kind.storages[sid].codecs[opt]
        return len(g.blocks) * (st.encode_s + st.decode_s)

    @staticmethod
    def quality_of(g: Group, sid: int, opt: str) -> float:
        opt = inner_of(opt) if is_offload(opt) else opt
        if opt == "raw":
            return 0.0
        return len(g.blocks) * g.kind.storages[sid].codecs[opt].rel_err ** 2

    def grad_terms(self, g: Group, sid: int, opt: str) -> dict[str, float]:
        """``{parameter or "<input>": 1 - cos}`` the gradient of one block loses to codec ``opt``
        on storage ``sid`` (measured; {} for raw or where the profile has no figure)."""
        opt = inner_of(opt) if is_offload(opt) else opt
        if opt == "raw":
            return {}
        return self.grad.get(g.kind.kind, {}).get(str(sid), {}).get(opt) or {}

    def ckpt_terms(self, g: Group, sid: int, opt: str, module: str) -> dict[str, float] | None:
        """What recomputing ``module`` from codec ``opt``'s copy of its input ``sid`` adds to
        ``grad_terms`` (measured jointly; {} where not measured; None where the profiler left the
        pair out: not allowed under a gradient cap)."""
        opt = inner_of(opt) if is_offload(opt) else opt
        if opt == "raw":
            return {}
        row = self.grad_ckpt.get(g.kind.kind, {}).get(str(sid), {}).get(opt, {})
        if module not in row:
            return {}
        if row[module] is None:
            return None
        alone = self.grad_terms(g, sid, opt)
        return {k: e - alone.get(k, 0.0) for k, e in row[module].items() if e > alone.get(k, 0.0)}

    def _grad_ok(self, kind: str, s: StorageProfile, codec: str) -> bool:
        """Under a gradient cap: no single figure above it, and a codec the profiler found too
        lossy to measure (``None``) is not admitted; one it did not measure is."""
        if self.max_grad_err is None:
            return True
        row = self.grad.get(kind, {}).get(str(s.id), {})
        if codec not in row:
            return True
        got = row[codec]
        return got is not None and max(got.values(), default=0.0) <= self.max_grad_err

    def grad_load(self, decisions: list[Decision]) -> float:
        """The largest summed gradient error of one parameter of one block (what
        ``max_grad_err`` caps): per group and parameter, the sum over its encoded storages."""
        worst = 0.0
        for g, d in zip(self.groups, decisions):
            load: dict[str, float] = {}
            for sid, c in d.codecs.items():
                terms = [self.grad_terms(g, sid, c)]
                terms += [self.ckpt_terms(g, sid, c, m.path) for m in g.kind.modules
                          if m.path in d.recompute and sid in m.inputs]  # fmt: skip
                for t in terms:
                    if t is None:
                        return math.inf
                    for k, e in t.items():
                        load[k] = load.get(k, 0.0) + e
            worst = max(worst, *load.values(), 0.0)
        return worst

    @staticmethod
    def candidates(g: Group) -> list[tuple[str, str]]:
        """(kind of action, module path) of each recompute/reform candidate."""
        return [("r", g.kind.modules[i].path) for i in g.rc] + [
            ("z", g.kind.reforms[i].path) for i in g.rf
        ]

    # -- offload ---------------------------------------------------------------------------------
    @staticmethod
    def hide_s(g: Group) -> float:
        """T_f: one block's forward, the window a block's copies hide in (0 if unmeasured)."""
        return next((m.recompute_s for m in g.kind.modules if m.path == ""), 0.0)

    def copy_s(self, g: Group, sid: int, opt: str = OFFLOAD) -> float:
        """One block's copy of storage ``sid`` under offload option ``opt`` one way (group
        average), in seconds."""
        assert self.offload is not None
        return self.offload.copy_s(self.bytes_of(g, sid, inner_of(opt)) / len(g.blocks))

    def stall_s(self, g: Group, d: Decision) -> float:
        """The group's copies' stall per step: the sum over its blocks b of max(0, C_b - T_f) +
        max(0, C_b - 2 T_f), C_b block b's own copies (a payload's bytes differ by block; the
        MILP's columns charge the group's average block, ``planner.highs``)."""
        off = [(sid, inner_of(c)) for sid, c in d.codecs.items() if is_offload(c)]
        if not off or self.offload is None:
            return 0.0
        copy_s, t_f = self.offload.copy_s, self.hide_s(g)
        return sum(stall_s(sum(copy_s(g.kind.bytes_of(b, sid, c)) for sid, c in off), t_f)
                   for b in g.blocks)  # fmt: skip

    def host_bytes(self, decisions: list[Decision]) -> int:
        """Bytes the decisions offload to host memory."""
        return sum(self.bytes_of(g, sid, inner_of(c)) for g, d in zip(self.groups, decisions)
                   for sid, c in d.codecs.items() if is_offload(c))  # fmt: skip

    # -- evaluation without linearization -------------------------------------------------------
    def dropped(self, g: Group, d: Decision) -> set[int]:
        """Storages nobody saves under decision ``d`` (see the module docstring)."""
        kind = g.kind
        silenced_by_rf = set()
        held = set()
        for r in kind.reforms:
            if r.path in d.reform:
                silenced_by_rf.update(r.silenced)
                held.update(r.added)
        for m in kind.modules:
            if m.path in d.recompute:
                held.update(m.inputs)
        out = set()
        for s in kind.storages:
            if s.id in held:
                continue
            if all(
                p in silenced_by_rf
                or (p != "!extern" and any(inside(site_module(p), a) for a in d.recompute))
                for p in s.sites
            ):
                out.add(s.id)
        return out

    def evaluate(self, decisions: list[Decision]) -> tuple[int, float, float]:
        """(activation bytes, added seconds per step, quality cost) of one decision per group."""
        total_b, total_t, total_q = 0, 0.0, 0.0
        for g, d in zip(self.groups, decisions):
            n = len(g.blocks)
            drop = self.dropped(g, d)
            for s in g.kind.storages:
                opt = d.codecs.get(s.id, "raw")
                if s.id in drop:
                    if opt != "raw":
                        raise ValueError(f"codec {opt} on dropped storage {s.name}")
                    continue
                total_b += self.bytes_of(g, s.id, opt)
                total_t += self.time_of(g, s.id, opt)
                total_q += self.quality_of(g, s.id, opt)
            for m in g.kind.modules:
                if m.path in d.recompute:
                    total_t += n * m.recompute_s
            for r in g.kind.reforms:
                if r.path in d.reform:
                    total_b += n * r.extra_bytes
                    total_t += n * max(r.delta_s, 0.0)
            total_t += self.stall_s(g, d)
        return total_b, total_t, total_q

    @property
    def baseline_bytes(self) -> int:
        return self.evaluate([Decision() for _ in self.groups])[0]

    # -- the MILP (linearized and solved in slimact.planner.highs) ------------------------------
    def solve(
        self,
        budget_bytes: float | None,
        max_quality: float | None = None,
        minimize: str = "time",
        time_limit: float = 60.0,
        tie_tolerance: float = 0.0,
    ) -> Result:
        """Minimize added time s.t. bytes <= ``budget_bytes`` (or minimize bytes);
        ``tie_tolerance``: near ties of time decided by a fixed order (``highs.run``)."""
        t0 = time.perf_counter()
        if getattr(self, "_built", None) is None:
            self._built = highs.build(self)
        res = highs.run(self._built, budget_bytes, max_quality, minimize, time_limit, tie_tolerance)
        solve_s = time.perf_counter() - t0
        if res.x is None:
            return Result([], 0, math.inf, math.inf, "infeasible", solve_s)
        decisions = [Decision(frozenset(), frozenset(), {}) for _ in self.groups]
        rec: list[set] = [set() for _ in self.groups]
        ref: list[set] = [set() for _ in self.groups]
        for (gi, kind, key), v in zip(self._built.cols, np.round(res.x).astype(int)):
            if not v:
                continue
            if kind == "r":
                rec[gi].add(key)
            elif kind == "z":
                ref[gi].add(key)
            elif kind == "y":
                decisions[gi].codecs[key[0]] = key[1]
        for gi, d in enumerate(decisions):
            d.recompute, d.reform = frozenset(rec[gi]), frozenset(ref[gi])
        b, t, q = self.evaluate(decisions)
        status = "optimal" if res.status == 0 else f"status {res.status}: {res.message}"
        return Result(
            decisions, b, t, q, status, solve_s, self.grad_load(decisions),
            res.get("tie_break", ""),
        )  # fmt: skip

    def min_bytes(self, max_quality: float | None = None) -> Result:
        return self.solve(None, max_quality, minimize="bytes")


def enumerate_group(problem: Problem, gi: int):
    """Every valid decision of group ``gi`` (exponential: small groups only)."""
    g = problem.groups[gi]
    cand = problem.candidates(g)
    for mask in itertools.product((0, 1), repeat=len(cand)):
        chosen = [c for c, on in zip(cand, mask) if on]
        if any(
            inside(a[1], b[1]) or inside(b[1], a[1]) for a, b in itertools.combinations(chosen, 2)
        ):
            continue
        base = Decision(
            frozenset(p for t, p in chosen if t == "r"), frozenset(p for t, p in chosen if t == "z")
        )
        drop = problem.dropped(g, base)
        live = [s.id for s in g.kind.storages if s.id not in drop]
        for opts in itertools.product(*[g.options[s] for s in live]):
            codecs = {s: o for s, o in zip(live, opts) if o != "raw"}
            yield Decision(base.recompute, base.reform, codecs)


def brute_force(
    problem: Problem, budget_bytes: float, max_quality: float | None = None
) -> tuple[float, list[Decision] | None]:
    """Minimum added time by enumerating every combination of every group's decisions."""
    best, arg = math.inf, None
    for combo in itertools.product(
        *[list(enumerate_group(problem, i)) for i in range(len(problem.groups))]
    ):
        b, t, q = problem.evaluate(list(combo))
        cap = problem.max_grad_err
        if cap is not None and problem.grad_load(list(combo)) > cap * (1 + 1e-9):
            continue
        off = problem.offload
        if off is not None and problem.host_bytes(list(combo)) > off.host_budget:
            continue
        if b <= budget_bytes and (max_quality is None or q <= max_quality) and t < best:
            best, arg = t, list(combo)
    return best, arg
