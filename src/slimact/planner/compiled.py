"""The planner over compiled blocks: one MILP over compile's recompute budgets and traced codecs.

Under torch.compile a block's saved tensors are decided by two knobs (``slimact.compiled.blocks``):
compile's region budget ``b`` (what its min-cut partitioner recomputes) and a traced codec ``c``
(how what it keeps is stored). Every pair ``o = (b, c)`` of a grid is an *option*; the planner
measures each option on one block of each kind, on the real batch, and picks one per block:

    bytes(o)   unique storages the compiled block's graphs save (read off its autograd graph,
               as the meter does), its input made inside the call, so an input the block keeps
               raw is counted and one it encodes is not (as in the model, where the raw
               residual stream is freed once the next block has encoded it)
    time(o)    fwd+bwd seconds of the compiled block: interleaved rounds over the options, every
               other round reversed (load drifts within a round), the median per-round ratio
               to the first option times that option's median
    err(o)     gradient error: max over the block's input and parameters of 1 - cos between
               the compiled block's gradients and the eager block's, for one random upstream
               gradient, on the kind's first and last block (the larger: depth matters);
               options above ``max_grad_err`` (default 2e-3, as ``auto``'s) are not candidates
               (traced INT4 often is not: BENCHMARKS.md §7)
    root       the eager model's bytes (the meter) minus its blocks' own (measured as above,
               eagerly): embedding, final norm, head, loss, and inputs shared by all blocks;
               the root stays eager and takes one of its own options ``r`` (keep, or an eager
               codec on its norm/linear inputs through the plan runtime; bytes, seconds and
               the model's gradient error measured: ``slimact.planner.compiled_root``)

    minimize   T = sum_r x_r * time(r) + sum_k sum_o n_ko * time_k(o)
    subject to sum_o n_ko = |blocks of kind k|,  sum_r x_r = 1,
               sum_r x_r * bytes(r) + sum_k sum_o n_ko * bytes_k(o) <= allowed

then, with T* that minimum, the same MILP minimizing the bytes subject also to
T <= (1 + tol) T*, over the options no lossier than the worst the fastest plan took (an exact
plan stays exact; ``TIME_TOLERANCE``, 1%: measured times are this noisy, and options that
fast can differ much in bytes, e.g. compile's budget 0.7 and 1.0 with the same codec). Both
passes are stated in the eager planner's row form and solved by ``slimact.planner.highs``, with
``n_ko`` integer, ``x_r`` binary (identical blocks are interchangeable, so the MILP counts them;
blocks take options in their order, the fewest bytes first). A uniform plan (every block at one
option) is a feasible point, so the solution is never slower than the best single option that
fits (by more than 1%, or the near ties': ``TIE_TOLERANCE``, options of a kind within 3% of
each other, go exact first, then leanest), never over the bytes the measured figures allow.
Compile's own ``activation_memory_budget`` is the column ``c = none``; its partition is one of
the options, not a competitor.

Offload (``host_budget`` given, CUDA only): one more option per kind, ``o_off`` =
``BlockChoice(0, "none", offload=True)`` (``slimact.compiled.offload``): the block keeps nothing
on the device, its input ``B`` bytes in pinned host memory. It is measured as the others with the
copies left out (bytes 0, seconds, error), plus its forward time ``T_f`` (the compiled block
without grad, what the wrapper runs in forward); the link is charged at solve time with
``slimact.planner.offload``'s stall model, ``time(o_off) = seconds + stall(B / bw, T_f)`` (one
input per block, so the stall is a constant per block), and the host bytes take one row,
``sum_k n_k,off * B_k <= host_budget``. The profile does not depend on the link, so one profile
serves any bandwidth and host budget.

Budgets are ``slimact.budget.Budget``: a share of the eager model's activation bytes (the
meter's count), or device memory with parameters, gradients and AdamW states included. After
the plan is installed, :func:`verify` measures the whole model; ``CompiledAutoConfig``
(``compiled-auto@25%``) re-solves with the overshoot taken off the budget once and warns if the
measured bytes still exceed it.
"""

from __future__ import annotations

import copy
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from slimact import sites, spec
from slimact.budget import Budget, BudgetWarning
from slimact.compiled.blocks import (
    BlockChoice,
    compile_block,
    compiled_saved_tensors,
    without_copies,
)
from slimact.compiled.devices import usable_codecs
from slimact.gradcheck import grad_error
from slimact.meter import MemoryReport, measure
from slimact.planner import highs
from slimact.planner.compiled_plan import CompiledPlan
from slimact.planner.compiled_root import (
    ROOT_CODECS,
    RootOption,
    capture_inputs,
    model_loss,
    profile_root,
)
from slimact.planner.milp import TIE_TOLERANCE
from slimact.planner.offload import OffloadOption, stall_s
from slimact.planner.profile import _warn_uncached, cache_path, profile_key, static_memory
from slimact.planner.profiler import kind_signature
from slimact.timing import interleaved, load_average
from slimact.utils import fmt_bytes

# 0.7: on a llama block compile's cut at 0.7 (and 0.8, 0.9) recomputes the norms' outputs and the
# SwiGLU product in backward, pointwise work it fuses: fewer bytes than budget 1 at its speed;
# 0.6 also drops SDPA's output and logsumexp and the residual after attention (it recomputes
# attention and o_proj), 0.5 recomputes v_proj too (the measured figures: BENCHMARKS.md §7)
BUDGETS = (1.0, 0.7, 0.6, 0.5, 0.25, 0.1, 0.0)
# INT6 (per row; SDPA's q and k exact, v and output INT8): fewer bytes than INT8 within the
# gradient cap; traced INT4 (over the cap on llama-20m, BENCHMARKS.md §7) is opt-in
CODECS = ("none", "int8", "int6")
MAX_GRAD_ERR = 2e-3  # as auto's: 1 - cos of any parameter's (or the input's) block gradient
# second stage: the fewest bytes among plans within this share of the fastest plan's seconds (the
# options' measured times are medians of interleaved rounds, ~1-3% apart run to run)
TIME_TOLERANCE = 0.01
# first stage: options of one kind (and the root's options) whose measured seconds are within
# TIE_TOLERANCE (the eager MILP's, ``milp.py``) of each other are equally fast; such near ties go
# by TIE_ORDER, not by which one the run's noise made a little faster
TIE_ORDER = "exact before lossy, then fewer bytes, then the profile's option order"
EXACT_ERR = 1e-9  # 1 - cos at or below this is rounding (exact options measure ~5e-13)
OFFLOAD_CHOICE = BlockChoice(0.0, "none", offload=True)  # the offload option (module docstring)


@dataclass
class OptionStat:
    """One option measured on one block: bytes it adds, fwd+bwd seconds (median)."""

    choice: BlockChoice
    bytes: int
    seconds: float
    grad_err: float = 0.0  # max over input and parameters of 1 - cos vs the eager block's
    host_bytes: int = 0  # offload: the input's bytes in host memory (``bytes``: the device's)
    forward_s: float = 0.0  # offload: the block's forward seconds, the window its copy hides in

    def to_dict(self) -> dict[str, Any]:
        d = {**self.choice.to_dict(), "bytes": self.bytes, "seconds": self.seconds,
             "grad_err": self.grad_err}  # fmt: skip
        if self.choice.offload:
            d.update(host_bytes=self.host_bytes, forward_s=self.forward_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OptionStat:
        return cls(
            BlockChoice.from_dict(d), int(d["bytes"]), float(d["seconds"]),
            float(d.get("grad_err", 0.0)), int(d.get("host_bytes", 0)),
            float(d.get("forward_s", 0.0)),
        )  # fmt: skip

    def seconds_with(self, offload: OffloadOption | None) -> float:
        """fwd+bwd seconds, the link's stall added for the offload option (module docstring)."""
        if not self.choice.offload or offload is None:
            return self.seconds
        return self.seconds + stall_s(offload.copy_s(self.host_bytes), self.forward_s)


@dataclass
class CompiledProfile:
    """Measured options per block kind, and the model's fixed parts."""

    blocks: dict[str, list[str]]  # kind -> block paths in model order
    options: dict[str, list[OptionStat]]  # kind -> one stat per option
    baseline_bytes: int  # the eager model's saved bytes (the meter)
    root_bytes: int  # what it saves outside its blocks
    static_bytes: int  # parameters, gradients, AdamW states
    batch: tuple[int, ...]
    profile_time_s: float
    load: tuple[float | None, float | None]
    root_options: list[RootOption] = field(default_factory=list)  # [] = keep only

    def roots(self) -> list[RootOption]:
        """The root's options ("keep" first; ``slimact.planner.compiled_root``)."""
        return self.root_options or [RootOption("none", self.root_bytes)]

    def option(self, kind: str, choice: BlockChoice) -> OptionStat:
        return next(s for s in self.options[kind] if s.choice == choice)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": COMPILED_PROFILE_FORMAT,
            "blocks": self.blocks,
            "options": {k: [s.to_dict() for s in v] for k, v in self.options.items()},
            "baseline_bytes": self.baseline_bytes,
            "root_bytes": self.root_bytes,
            "static_bytes": self.static_bytes,
            "batch": list(self.batch),
            "profile_time_s": self.profile_time_s,
            "load": list(self.load),
            "root_options": [r.to_dict() for r in self.root_options],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompiledProfile:
        if d.get("format") != COMPILED_PROFILE_FORMAT:
            raise ValueError(
                f"compiled profile format {d.get('format')!r}, not {COMPILED_PROFILE_FORMAT}"
            )
        return cls(
            blocks={k: list(v) for k, v in d["blocks"].items()},
            options={k: [OptionStat.from_dict(s) for s in v] for k, v in d["options"].items()},
            baseline_bytes=int(d["baseline_bytes"]),
            root_bytes=int(d["root_bytes"]),
            static_bytes=int(d["static_bytes"]),
            batch=tuple(d["batch"]),
            profile_time_s=float(d["profile_time_s"]),
            load=tuple(d["load"]),
            root_options=[RootOption.from_dict(r) for r in d["root_options"]],
        )


# ----------------------------------------------------------------------------- measuring
def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"a block returned {type(out).__name__}; expected a tensor (or a tuple)")


def _unique_bytes(tensors: Sequence[torch.Tensor], skip: set[int]) -> int:
    """Bytes of the unique storages of ``tensors`` whose key is not in ``skip`` (grows it)."""
    total = 0
    for t in tensors:
        key = sites.storage_key(t)
        if key not in skip:
            skip.add(key)
            total += t.untyped_storage().nbytes()
    return total


class _BlockRun:
    """Calls of one block on captured inputs: its input made inside the call (see docstring).

    Bytes count unique storages, without parameters and without the block's other inputs
    (RoPE tables, masks: made once outside the blocks and shared by all of them, so they are
    in the root's bytes; a codec's packed copy of one is the block's own and counts)."""

    def __init__(self, fwd: Callable[..., Any], block: nn.Module, args: tuple, kwargs: dict):
        self.fwd, self.block, self.args, self.kwargs = fwd, block, args, kwargs
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.x = args[0].detach().requires_grad_(args[0].is_floating_point())
        shared = [*args[1:], *kwargs.values(), *block.parameters(), *block.buffers()]
        self.skip = {sites.storage_key(t) for t in shared if isinstance(t, torch.Tensor)}

    def forward(self) -> torch.Tensor:
        with torch.enable_grad():
            h = self.x.clone()  # made here: counted if the block keeps it raw
            return _first_tensor(self.fwd(h, *self.args[1:], **self.kwargs))

    def saved_bytes(self) -> int:
        """What the compiled graphs keep for backward (read off the autograd graph)."""
        return _unique_bytes(compiled_saved_tensors(self.forward()), set(self.skip))

    def eager_saved_bytes(self) -> int:
        """What the eager block saves (its saves, through the site router)."""
        stored: list[torch.Tensor] = []
        with sites.tracking(self.block), sites.listening(lambda ev: stored.extend(ev.stored)):
            self.forward()
        return _unique_bytes(stored, set(self.skip))

    def forward_no_grad(self) -> None:
        with torch.no_grad():
            self.fwd(self.x, *self.args[1:], **self.kwargs)

    def step(self, upstream: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """fwd + bwd; the gradients of the input and the parameters (``upstream``: dL/d out)."""
        out = self.forward()
        leaves = [self.x, *self.params] if self.x.requires_grad else self.params
        g = torch.ones_like(out) if upstream is None else upstream
        return list(torch.autograd.grad(out, leaves, g, allow_unused=True))


def profile_compiled(
    model: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    budgets: Sequence[float] = BUDGETS,
    codecs: Sequence[str] = CODECS,
    rounds: int = 5,
    progress: Callable[[str], None] | None = None,
    root_codecs: Sequence[str] = ROOT_CODECS,
    root_reform: bool = True,
    offload: bool = False,
) -> CompiledProfile:
    """Measure every option of the grid on one block of each kind (module docstring), and the
    offload option if ``offload``; the model is not changed (options run on copies of its
    blocks; the RNG state is restored)."""
    t0, load0 = time.perf_counter(), load_average()
    mods = dict(model.named_modules())
    kinds: dict[str, list[str]] = {}
    for p in sites.block_paths(model):
        kinds.setdefault(kind_signature(mods[p]), []).append(p)
    if not kinds:
        raise ValueError(f"{type(model).__name__} has no repeated blocks to compile")
    codecs = usable_codecs(codecs, ids.device.type)  # lossy traced codecs: not on CUDA
    choices = [BlockChoice(b, c) for b in budgets for c in codecs]
    if offload:
        choices.append(OFFLOAD_CHOICE)
    with torch.random.fork_rng(devices=[]):
        probes = {k: list(dict.fromkeys((ps[0], ps[-1]))) for k, ps in kinds.items()}
        inputs = capture_inputs(model, ids, targets, [p for ps in probes.values() for p in ps])
        base = metered_bytes(model, ids, targets)
        options, eager = {}, {}
        for kind, paths in kinds.items():
            args, kwargs = inputs[paths[0]]
            eager[kind] = _BlockRun(
                mods[paths[0]], mods[paths[0]], args, kwargs
            ).eager_saved_bytes()
            runs, errs = {}, dict.fromkeys(choices, 0.0)
            for path in probes[kind]:  # the error: max over the kind's first and last block
                a, kw = inputs[path]
                exact = _BlockRun(mods[path], mods[path], a, kw)
                out = exact.forward().detach()
                gen = torch.Generator(out.device).manual_seed(0)
                upstream = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
                ref = exact.step(upstream)
                for ch in choices:
                    if progress:
                        progress(f"compiling {path} under {ch.label}")
                    blk = copy.deepcopy(mods[path])
                    run = _BlockRun(without_copies(compile_block(blk, ch)), blk, a, kw)
                    errs[ch] = max(errs[ch], grad_error(run.step(upstream), ref))  # (compiles)
                    runs.setdefault(ch, run)  # bytes and time: on the first block
            stats = {ch: r.saved_bytes() for ch, r in runs.items()}
            fns = {ch.label: r.step for ch, r in runs.items()}
            if offload:  # the offload wrapper's forward: the compiled block without grad
                fns[FORWARD] = runs[OFFLOAD_CHOICE].forward_no_grad
            timing = interleaved(  # 21 options a round: the reversed rounds cancel drift
                fns, rounds, warmup=1, alternate=True
            )
            ref = choices[0].label  # seconds: per-round ratios to it (load cancels) x its median
            secs = {c: timing.median_s(ref) * timing.ratio(c.label, ref).median for c in choices}
            options[kind] = [OptionStat(c, stats[c], secs[c], errs[c]) for c in choices]
            if offload:
                off = options[kind][-1]
                off.host_bytes = runs[OFFLOAD_CHOICE].x.untyped_storage().nbytes()
                off.forward_s = timing.median_s(ref) * timing.ratio(FORWARD, ref).median
        root_bytes = base.total_bytes - sum(eager[k] * len(ps) for k, ps in kinds.items())
        if progress:
            progress("measuring the root's options")
        roots = profile_root(model, ids, targets, root_bytes, root_codecs, rounds, root_reform)
    return CompiledProfile(
        blocks=kinds,
        options=options,
        baseline_bytes=base.total_bytes,
        root_bytes=root_bytes,
        static_bytes=static_memory(model)["total"],
        batch=tuple(ids.shape),
        profile_time_s=time.perf_counter() - t0,
        load=(load0, load_average()),
        root_options=roots,
    )


FORWARD = "forward (no grad)"  # the timing key of the offload option's forward window
COMPILED_PROFILE_FORMAT = 1  # bumped when what a compiled profile records changes


def profile_summary(profile: CompiledProfile) -> dict[str, Any]:
    """What a plan records of the profile it was solved from (``CompiledPlan.meta``)."""
    return {
        "batch": list(profile.batch),
        "root_bytes": profile.root_bytes,
        "options": {k: [s.to_dict() for s in v] for k, v in profile.options.items()},
        "root_options": [r.to_dict() for r in profile.roots()],
    }


def cached_compiled_profile(
    model: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    budgets: Sequence[float] = BUDGETS,
    codecs: Sequence[str] = CODECS,
    rounds: int = 5,
    cache_dir: str | Path | None = "",
    **kwargs: Any,
) -> CompiledProfile:
    """:func:`profile_compiled` through a JSON cache, as ``auto``'s profiles are
    (``slimact.planner.profile.cached_profile``): keyed by the model's structure and weights,
    the batch's shape, dtype and device, the option grid and torch's version, so that a run
    planned again on the same model and batch solves the same measured figures and takes the
    same plan (measured times differ run to run by a few percent, enough to swap options that
    are about as fast). ``cache_dir``: '' = the default directory, None = no cache. An
    unreadable entry is profiled again; an unwritable directory is warned about once."""
    if cache_dir is None:
        return profile_compiled(model, ids, targets, budgets, codecs, rounds, **kwargs)
    key = profile_key(
        model, ids, targets, name=f"compiled-{type(model).__name__}",
        codecs=tuple(usable_codecs(codecs, ids.device.type)), budgets=tuple(budgets),
        rounds=rounds, format=COMPILED_PROFILE_FORMAT, **kwargs,
    )  # fmt: skip
    path = cache_path(cache_dir or None, key)
    if path.is_file():
        try:
            return CompiledProfile.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"slimact: ignoring unreadable profile cache {path}: {e}", stacklevel=2)
    prof = profile_compiled(model, ids, targets, budgets, codecs, rounds, **kwargs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(prof.to_dict()))
        tmp.replace(path)
    except OSError as e:
        _warn_uncached(path.parent, e)
    return prof


# ----------------------------------------------------------------------------- solving
def _allowed(profile: CompiledProfile, budget: Budget) -> int:
    static = 0 if budget.relative else profile.static_bytes
    return budget.allowed(profile.baseline_bytes, static)


def solve_compiled(
    profile: CompiledProfile,
    budget: Budget | str | int,
    max_grad_err: float | None = MAX_GRAD_ERR,
    time_tolerance: float = TIME_TOLERANCE,
    offload: OffloadOption | None = None,
    tie_tolerance: float = TIE_TOLERANCE,
) -> CompiledPlan:
    """The fastest choice per block, and for the eager root, whose predicted bytes fit
    ``budget`` (module docstring), among the options whose measured gradient error is at most
    ``max_grad_err`` (None: all); then, among the plans within ``time_tolerance`` of its
    seconds, the one with the fewest bytes that takes no option with a larger gradient error
    than the fastest plan's worst (options equally fast within measurement noise can differ
    much in bytes, e.g. compile budget 0.7 against 1.0 with the same codec; an exact plan
    stays exact). ``offload`` admits the profile's offload option, its stall charged by the
    link's bandwidth and its host bytes capped by the host budget (module docstring).

    Near ties: a kind's options (and the root's) whose seconds are within ``tie_tolerance`` of
    the fastest of their group are solved as equally fast (``near_ties``) and taken in
    ``TIE_ORDER``, so that measurement noise between two profiles of one model does not pick
    the plan; the plan's ``meta["tie_break"]`` records the groups and the rule."""
    if not time_tolerance >= 0:
        raise ValueError(f"time_tolerance must be >= 0, got {time_tolerance!r}")
    if not tie_tolerance >= 0:
        raise ValueError(f"tie_tolerance must be >= 0, got {tie_tolerance!r}")
    budget = spec.parse_budget(budget)
    allowed = _allowed(profile, budget)
    ok = lambda s: max_grad_err is None or s.grad_err <= max_grad_err  # noqa: E731
    admit = lambda s: ok(s) and (offload is not None or not s.choice.offload)  # noqa: E731
    var = [(k, s) for k, stats in profile.options.items() for s in stats if admit(s)]
    roots = [r for r in profile.roots() if ok(r)]
    kinds = list(profile.options)
    nv = len(var)
    measured = [s.seconds_with(offload) for _, s in var] + [r.seconds for r in roots]
    size = [float(s.bytes) for _, s in var] + [float(r.bytes) for r in roots]
    host = [float(s.host_bytes) for _, s in var] + [0.0] * len(roots)
    err = [s.grad_err for _, s in var] + [r.grad_err for r in roots]
    group = [k for k, _ in var] + [None] * len(roots)  # None: the root's options
    cost, ties = near_ties(measured, group, tie_tolerance)
    labels = [s.choice.label for _, s in var] + [r.label for r in roots]
    rank = tie_ranks(err, size)
    # the eager planner's row form (planner.highs): a column per option, its value the number
    # of blocks of its kind that take it; one row per kind (its blocks), one for the root
    rows = [{j: 1.0 for j, (k, _) in enumerate(var) if k == kind} for kind in kinds]
    rows.append({nv + i: 1.0 for i in range(len(roots))})
    n = [float(len(profile.blocks[k])) for k in kinds] + [1.0]
    lo, hi = list(n), list(n)
    if offload is not None and any(host):
        rows.append({j: h for j, h in enumerate(host) if h})
        lo.append(-np.inf)
        hi.append(float(offload.host_budget))
    cols = [(0, "option", j) for j in range(len(cost))]
    built = highs.Rows(
        cols, {c: j for j, c in enumerate(cols)}, rows, lo, hi,
        mem=dict(enumerate(size)), obj=dict(enumerate(cost)), qual={},
        counts={j: n[kinds.index(var[j][0])] if j < nv else 1.0 for j in range(len(cost))},
    )  # fmt: skip
    res = highs.run(built, allowed)
    if res.x is not None:  # among the plans as fast, the first in TIE_ORDER
        res = tie_break(built, allowed, res, (cost,), rank)
    if res.x is not None and time_tolerance > 0:
        # the leanest plan as fast within tolerance, and no lossier: only options whose error is
        # at most the worst the fastest plan took (an exact plan stays exact)
        x = np.round(res.x)
        worst = max(float(np.array(err)[x > 0].max()), EXACT_ERR)
        cap = float(np.array(cost) @ x) * (1.0 + time_tolerance)
        lean = built._replace(  # time capped; lossier options bounded to 0
            rows=[*rows, dict(enumerate(cost))], lo=[*lo, -np.inf], hi=[*hi, cap],
            counts={j: (m if err[j] <= worst else 0.0) for j, m in built.counts.items()},
        )  # fmt: skip
        again = highs.run(lean, allowed, minimize="bytes")
        if again.x is not None:  # among the plans as lean (and as fast), the first in TIE_ORDER
            res = tie_break(lean, allowed, again, (size, cost), rank)
    if res.x is None:
        floor = min(r.bytes for r in roots) + sum(
            min(s.bytes for kk, s in var if kk == k) * len(profile.blocks[k]) for k in kinds
        )
        raise ValueError(
            f"budget {budget} allows {fmt_bytes(allowed)} of activations; the smallest compiled "
            f"plan keeps {fmt_bytes(floor)} ({floor / profile.baseline_bytes:.1%} of the eager "
            f"model's {fmt_bytes(profile.baseline_bytes)}): raise the budget"
        )
    picks: dict[str, list[OptionStat]] = {k: [] for k in kinds}
    for j, (k, s) in enumerate(var):
        picks[k].extend([s] * int(round(res.x[j])))
    root = roots[int(np.argmax(res.x[nv:]))]
    choices = {}
    for k in kinds:
        ordered = sorted(picks[k], key=lambda s: (s.bytes, s.seconds))
        choices.update({p: s.choice for p, s in zip(profile.blocks[k], ordered)})
    flat = [s for k in kinds for s in picks[k]]
    meta: dict[str, Any] = {"profile_time_s": round(profile.profile_time_s, 2),
                            "solver": "scipy HiGHS"}  # fmt: skip
    meta["tie_break"] = {
        "tolerance": tie_tolerance,
        "rule": TIE_ORDER,
        "near_ties": {
            "(root)" if g is None else g: [[labels[j] for j in ids] for ids in groups]
            for g, groups in ties.items()
        },
    }
    if offload is not None:
        meta.update(host_bytes=int(sum(s.host_bytes for s in flat)),
                    host_budget=offload.host_budget, link_bandwidth=offload.bandwidth)  # fmt: skip
    return CompiledPlan(
        choices={p: choices[p] for ps in profile.blocks.values() for p in ps},
        budget=str(budget),
        allowed_bytes=int(allowed),
        predicted_bytes=int(root.bytes + sum(s.bytes for s in flat)),
        predicted_seconds=float(root.seconds + sum(s.seconds_with(offload) for s in flat)),
        baseline_bytes=profile.baseline_bytes,
        meta=meta,
        root=None if root.keeps else root,
    )


def near_ties(
    seconds: list[float], group: list[Any], tolerance: float
) -> tuple[list[float], dict[Any, list[list[int]]]]:
    """``seconds`` with near ties made equal: within each ``group`` (a kind's options), sorted
    by time, an option within ``tolerance`` of its tie group's fastest joins that group and
    takes its seconds; the groups of more than one option, by ``group``."""
    out = list(seconds)
    ties: dict[Any, list[list[int]]] = {}
    for g in dict.fromkeys(group):
        ids = sorted((j for j in range(len(seconds)) if group[j] == g), key=seconds.__getitem__)
        runs: list[list[int]] = []
        for j in ids:
            if runs and seconds[j] <= seconds[runs[-1][0]] * (1.0 + tolerance):
                runs[-1].append(j)
            else:
                runs.append([j])
            out[j] = seconds[runs[-1][0]]
        if any(len(r) > 1 for r in runs):
            ties[g] = [sorted(r) for r in runs if len(r) > 1]
    return out, ties


def tie_ranks(err: list[float], size: list[float]) -> list[float]:
    """Each option's place in ``TIE_ORDER``: exact (error at most ``EXACT_ERR``) before lossy,
    then fewer bytes, then the given order."""
    order = sorted(range(len(err)), key=lambda j: (err[j] > EXACT_ERR, size[j], j))
    return [float(order.index(j)) for j in range(len(err))]


def tie_break(
    built: highs.Rows, allowed: float, res: Any, keys: tuple[list[float], ...], rank: list[float]
):
    """Among the solutions of ``built`` no worse than ``res`` in any of ``keys`` (seconds,
    bytes), the one whose options come first in ``TIE_ORDER`` (the least sum of
    ``tie_ranks``); ``res`` where that solve fails. A solve of its own, on ranks, so the order
    never weighs against a real difference of seconds or bytes, nor drowns in the solver's gap."""
    x = np.round(res.x)
    rows, lo, hi = list(built.rows), list(built.lo), list(built.hi)
    for key in keys:
        value = float(np.array(key) @ x)
        rows.append(dict(enumerate(key)))
        lo.append(-np.inf)
        hi.append(value + 1e-9 * abs(value))
    again = highs.run(built._replace(rows=rows, lo=lo, hi=hi, obj=dict(enumerate(rank))), allowed)
    return again if again.x is not None else res


def metered_bytes(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> MemoryReport:
    """The meter's report of one forward (exact, compiled blocks included)."""
    with measure(model, n_tokens=ids.numel()) as m:
        model_loss(model, ids, targets)
    return m.report


def verify(plan: CompiledPlan, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> int:
    """Measure the installed plan: the meter's bytes of one forward of the whole model."""
    with torch.random.fork_rng(devices=[]):
        report = metered_bytes(model, ids, targets)
    live = report.total_bytes
    plan.measured_bytes = int(live)
    if report.host_bytes or "host_bytes" in plan.meta:
        plan.meta["measured_host_bytes"] = int(report.host_bytes)
    if live > plan.allowed_bytes:
        warnings.warn(
            f"compiled plan for budget {plan.budget} keeps {fmt_bytes(live)}, "
            f"{fmt_bytes(live - plan.allowed_bytes)} over the {fmt_bytes(plan.allowed_bytes)} "
            f"it allows (predicted {fmt_bytes(plan.predicted_bytes)})",
            BudgetWarning,
            stacklevel=2,
        )
    return int(live)
