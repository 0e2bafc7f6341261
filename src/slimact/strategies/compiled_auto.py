"""``compiled-auto@<budget>``: the compiled planner as a strategy.

Profiles every (region budget, traced codec) option on one block of each kind, solves for the
fastest choice per block that fits the budget (``slimact.planner.compiled``), compiles each
block under its choice and measures the whole model once: if the measured bytes exceed the
budget it re-solves once with the overshoot taken off, and warns (``BudgetWarning``) if they
still do. Without ``batch``/``seq`` it plans on the first training forward, on that batch
(before the forward runs, so that step already runs the plan; in a worker thread, so an enclosing
``slimact.measure`` does not count the profiling passes): a watcher of the model's plan runtime
(``PlanRuntime.watch``), which waits with no plan until then and takes the root's option; with
them, at ``apply`` time on random tokens of that shape. The solved plan is
``slimact.state_of(model).compiled_plan``.

``slimact.apply(model, "auto@25%", compile=True)`` is this strategy (see ``registry``).
Specs: ``compiled-auto@25%``, ``compiled-auto@25%,codecs=none/int8,budgets=1/0.5/0,rounds=3``,
``compiled-auto@10%,max_grad_err=none`` (admit every option, traced INT4 included),
``compiled-auto@25%,time_tolerance=0`` (the fastest plan, not the leanest as fast within 1%),
``compiled-auto@10%,host_budget=8GiB`` (offload admitted: a block may keep only its input, in
pinned host memory; CUDA only, the link's bandwidth measured once, ``link_bw=<bytes/s>`` to
give it instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn

from slimact import sites, spec
from slimact.budget import Budget
from slimact.classify import call_batch
from slimact.codecs.offload import check_device, check_model
from slimact.compiled.blocks import compile_blocks_with
from slimact.compiled.codec import CODECS as TRACED_CODECS
from slimact.hf_inputs import random_token_batch, refuse_unless_token_ids
from slimact.planner.apply import PlanRuntime, install, runtime_of, watched_runtime
from slimact.planner.compiled import (
    BUDGETS,
    CODECS,
    MAX_GRAD_ERR,
    TIME_TOLERANCE,
    CompiledPlan,
    CompiledProfile,
    cached_compiled_profile,
    profile_summary,
    solve_compiled,
    verify,
)
from slimact.planner.compiled_root import install_root
from slimact.planner.offload import OffloadOption, link_bandwidth, parse_host_budget
from slimact.planner.scope import scope
from slimact.registry import (
    AppliedChange,
    FilterFn,
    StrategyConfig,
    applied,
    register_strategy,
)
from slimact.spec import listed, optional
from slimact.state import reset_field, state_of
from slimact.utils import in_worker_thread


@dataclass(frozen=True)
class CompiledAutoConfig(StrategyConfig):
    """``budget``: '25%' | '6GiB' | bytes (required); ``budgets``: compile region budgets to
    try; ``codecs``: traced codecs to try; ``rounds``: interleaved timing rounds per option;
    ``time_tolerance``: the plan keeps the fewest bytes among plans within this share of the
    fastest one's time, no lossier than it (0: the fastest plan);
    ``max_grad_err``: options whose measured block-gradient error (1 - cos, worst parameter)
    exceeds it are not candidates (None: every option);
    ``batch``/``seq``: plan at apply time on random tokens of that shape (else on the first
    training forward); ``cache``: the profile's JSON cache directory ('' = ~/.cache/slimact,
    as ``auto``'s; None = no cache), so that a run planned again on the same model, weights
    and batch shape solves the same profile and takes the same plan; ``host_budget``: bytes of
    pinned host memory offload may use ('8GiB'; None: no offload option), ``link_bw``: the host
    link's bandwidth in bytes/s (None: measured on the device)."""

    budget: Budget | str | int | None = None
    budgets: tuple[float, ...] = BUDGETS
    codecs: tuple[str, ...] = CODECS
    rounds: int = 5
    max_grad_err: float | None = MAX_GRAD_ERR
    time_tolerance: float = TIME_TOLERANCE
    batch: int | None = None
    seq: int | None = None
    seed: int = 0
    cache: str | None = ""
    host_budget: str | int | None = None
    link_bw: float | None = None
    compile_kwargs: dict = field(default_factory=dict, compare=False, hash=False)

    spec_budget: ClassVar = True
    spec_fields: ClassVar = {
        "codecs": listed(), "budgets": listed(float), "rounds": int,
        "max_grad_err": optional(float), "time_tolerance": float, "cache": optional(str),
        "host_budget": str, "link_bw": float,
    }  # fmt: skip

    def __post_init__(self) -> None:
        if self.budget is not None:
            object.__setattr__(self, "budget", spec.parse_budget(self.budget))
        if not self.budgets or any(not 0.0 <= float(b) <= 1.0 for b in self.budgets):
            raise ValueError(f"budgets must be numbers in [0, 1], got {self.budgets!r}")
        bad = [c for c in self.codecs if c not in TRACED_CODECS]
        if not self.codecs or bad:
            raise ValueError(f"codecs must be among {', '.join(TRACED_CODECS)}, got {bad or '()'}")
        if self.max_grad_err is not None and not self.max_grad_err >= 0:
            raise ValueError(f"max_grad_err must be >= 0 or None, got {self.max_grad_err!r}")
        tol = self.time_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise ValueError(f"time_tolerance must be a number >= 0, got {self.time_tolerance!r}")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be an int >= 1, got {self.rounds!r}")
        parse_host_budget(self.host_budget)  # a share or a typo: refused here, in one line
        if self.link_bw is not None and not self.link_bw > 0:
            raise ValueError(f"link_bw must be bytes/s > 0, got {self.link_bw!r}")
        if (self.batch is None) != (self.seq is None):
            raise ValueError("give both batch and seq (plan at apply time) or neither")

    @classmethod
    def from_spec(cls, text: str) -> CompiledAutoConfig:
        """``compiled-auto@25%[,codecs=none/int8][,budgets=1/0.5/0][,rounds=3][,max_grad_err=x]
        [,time_tolerance=0.01]`` -> its config (``slimact.spec``)."""
        return spec.configure(cls(), spec.parse_part(text))


def plan_compiled(
    model: nn.Module,
    config: CompiledAutoConfig,
    ids: torch.Tensor,
    targets: torch.Tensor,
    profile: CompiledProfile | None = None,
    runtime: PlanRuntime | None = None,
) -> list[AppliedChange]:
    """Profile (unless given one of this model, e.g. to solve several budgets on one profile),
    solve, install and verify (module docstring); the plan goes to the state. On an error
    nothing stays installed. ``runtime``: the model's own, still without a plan (the lazy
    planner's), which takes the root's option."""
    _refuse_another_runtime(model, runtime)  # its profile would mix encoded and raw bytes
    offload = offload_option(config, ids.device)
    if profile is None:
        profile = cached_compiled_profile(
            model, ids, targets, config.budgets, config.codecs, config.rounds, config.cache,
            **({"offload": True} if offload is not None else {}),
        )  # fmt: skip
    plan = solve_compiled(
        profile, config.budget, config.max_grad_err, config.time_tolerance, offload
    )
    changes = install_compiled(model, plan, runtime=runtime, **config.compile_kwargs)
    try:
        measured = verify(plan, model, ids, targets)
        tighter = plan.allowed_bytes - (measured - plan.allowed_bytes)
        if measured > plan.allowed_bytes and tighter > profile.root_bytes:
            _undo(changes)  # once: re-solve with the overshoot taken off the budget
            changes = []
            retry = solve_compiled(
                profile, _tighter(config.budget, tighter, profile), config.max_grad_err,
                offload=offload,
            )  # fmt: skip
            retry.budget, retry.allowed_bytes = plan.budget, plan.allowed_bytes
            retry.meta["resolved_for"] = tighter
            changes = install_compiled(model, retry, runtime=runtime, **config.compile_kwargs)
            plan = retry
            verify(plan, model, ids, targets)
    except BaseException:
        _undo(changes)
        raise
    plan.meta["profile"] = profile_summary(profile)
    state_of(model).compiled_plan = plan
    return changes


def _tighter(budget: Budget, allowed: int, profile: CompiledProfile) -> Budget:
    """``budget`` of the same kind (a share or a size) that allows ``allowed`` activation bytes."""
    if not budget.relative:
        total = allowed + profile.static_bytes
        return Budget(f"{total}B", total=total)
    pct = f"{100 * allowed / profile.baseline_bytes:.6f}"
    return Budget(f"{pct}%", share=float(pct) / 100)


def _refuse_another_runtime(model: nn.Module, own: PlanRuntime | None = None) -> None:
    """compiled-auto plans the root's codec too, on its own runtime (``own``, still without a
    plan): a model carrying any other slimact plan is refused."""
    rt = runtime_of(model)
    if rt is not None and (rt is not own or rt.plan is not None):
        raise ValueError(
            f"compiled-auto plans a model that carries no other slimact plan (this one: "
            f"{scope(rt.plan, rt.planner)}; it plans the root's codec too): "
            "slimact.revert(model) first"
        )


def offload_option(config: CompiledAutoConfig, device: torch.device) -> OffloadOption | None:
    """The offload option of ``config`` on ``device`` (None without a host budget); a host
    budget where offload cannot run (a CPU) is refused in one line."""
    total = parse_host_budget(config.host_budget)
    if total is None:
        return None
    check_device(device)
    return OffloadOption(config.link_bw or link_bandwidth(device), total)


def install_plan(model: nn.Module, plan: CompiledPlan) -> list[AppliedChange]:
    """Install a plan solved before (a checkpoint's ``compiled_plan.json``) on a model under a
    ``compiled-auto`` strategy that has not planned yet: no profiling, no solving, so a resumed
    run trains with the plan it had. Returns the changes (also shown by ``slimact.applied``)."""
    lazy = _pending(model)
    check_blocks(model, plan)
    lazy.unwatch()
    lazy.installed = install_compiled(
        model, plan, runtime=lazy.runtime, **lazy.config.compile_kwargs
    )
    state_of(model).compiled_plan = plan
    lazy.show(plan, "installed from a saved plan")
    return lazy.installed


def _pending(model: nn.Module) -> _LazyPlanner:
    for c in applied(model):
        owner = getattr(c.undo, "__self__", None)
        if isinstance(owner, _LazyPlanner):
            if state_of(model).compiled_plan is not None:
                raise ValueError("this model's compiled-auto has already planned")
            return owner
    raise ValueError(
        "the model carries no compiled-auto strategy to install a plan for; apply "
        "'compiled-auto@<budget>' (or 'auto@<budget>' with compile=True) first"
    )


def install_compiled(
    model: nn.Module,
    plan: CompiledPlan,
    filter_fn: FilterFn | None = None,
    runtime: PlanRuntime | None = None,
    **compile_kwargs: Any,
) -> list[AppliedChange]:
    """Install ``plan``: its eager part on the plan runtime first (``CompiledPlan.eager``: what
    the blocks compile is the reformulated model), then each block compiled under its choice,
    then the root's option on the plan runtime: the one install path of every compiled plan
    (one ``compiled-auto`` solved, a fixed ``compiled-*`` strategy's uniform one, an eager spec's
    under ``compile=True``, a saved one). With an eager part the runtime takes that part and the
    root's option merged into one plan (``CompiledPlan.runtime_plan``; a conflict is refused
    before anything is installed). An offload choice is refused on a CPU model in one line,
    before anything is compiled; a failure takes back what was installed. ``filter_fn`` limits
    the compiled blocks (and the eager part); ``compile_kwargs`` go to ``torch.compile``."""
    if any(c.offload for c in plan.choices.values()):
        check_model(model)  # one line: a CPU model's tensors are in host memory already
    if plan.eager is not None:
        if runtime is not None:
            raise ValueError(
                "compiled-auto's own plan has no eager part (the spec's eager parts are applied "
                "before it); a plan with one installs with slimact.apply(model, plan)"
            )
        return _install_with_eager(model, plan, filter_fn, compile_kwargs)
    changes = compile_blocks_with(model, plan.choices, filter_fn, **compile_kwargs)
    if plan.root is not None:
        try:
            changes += install_root(model, plan.root, runtime)
        except Exception:
            _undo(changes)
            raise
    return changes


def _install_with_eager(
    model: nn.Module, plan: CompiledPlan, filter_fn: FilterFn | None, compile_kwargs: dict
) -> list[AppliedChange]:
    """The eager part (merged with the root's option) on the runtime, then the blocks."""
    eager = plan.runtime_plan()  # (the merge's conflicts: refused here, nothing installed)
    rooted = plan.root is not None and not plan.root.keeps
    if filter_fn is not None and rooted:
        raise ValueError(
            "a compiled plan with an eager part and a root option takes no filter_fn: the two "
            "run as one plan on the runtime, and the root's option is for the whole root"
        )
    if runtime_of(model) is not None:
        raise ValueError(
            "the compiled plan's eager part goes on the plan runtime, and this model carries "
            "a slimact plan already (one runtime per model): slimact.revert(model) first"
        )
    changes = install(model, eager, filter_fn=filter_fn)
    changes[0].detail = f"eager part of the compiled plan: {plan.eager_label()}"
    try:
        changes += compile_blocks_with(model, plan.choices, filter_fn, **compile_kwargs)
    except BaseException:
        _undo(changes)
        raise
    return changes


def check_blocks(model: nn.Module, plan: CompiledPlan) -> None:
    """A plan names exactly ``model``'s blocks, or it was solved for another model."""
    want = set(sites.block_paths(model))
    if set(plan.choices) != want:
        raise ValueError(
            f"the compiled plan is for blocks {sorted(plan.choices)[:4]}..., this model's are "
            f"{sorted(want)[:4]}...: it was solved for another model"
        )


def _undo(changes: list[AppliedChange]) -> None:
    for c in reversed(changes):
        if c.undo is not None:
            c.undo()


class _LazyPlanner:
    """A watcher of the model's plan runtime (``PlanRuntime.watch``, before the runtime enters
    its plan): plans on the first training forward's batch, installs the plan (the blocks
    compiled, the root's option on that runtime, so it serves this very call), then stops
    watching.

    If planning fails, the error is raised, nothing of the plan stays installed, and every later
    training forward raises again naming it (the model never trains without the plan it was
    given while ``slimact.applied`` still shows it); ``slimact.applied`` says so as well."""

    def __init__(self, model: nn.Module, config: CompiledAutoConfig) -> None:
        self.model, self.config, self.installed = model, config, []
        self.head: AppliedChange | None = None  # the strategy's row in slimact.applied
        self.error: Exception | None = None
        self.runtime, self.unwatch = watched_runtime(model, self)  # no plan until it plans

    def before(self, args: tuple, kwargs: dict) -> None:
        module = self.model
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.error is not None:
            raise RuntimeError(
                f"compiled-auto (budget {self.config.budget}) could not plan this model on its "
                f"first training forward ({type(self.error).__name__}: {self.error}); it does "
                "not train without its plan: slimact.revert(model), then apply another "
                "strategy or budget"
            ) from self.error
        ids, targets = call_batch(module, args, kwargs)
        if not isinstance(ids, torch.Tensor) or targets is None:
            return
        plan = lambda: plan_compiled(module, self.config, ids, targets, runtime=self.runtime)  # noqa: E731
        self.unwatch()  # the planner runs the model, on copies too
        try:
            self.installed = in_worker_thread(plan, ids.device.type)  # unseen by a meter
        except BaseException as e:
            self.unwatch = self.runtime.watch(self)  # (interrupted: the next one plans again)
            if not isinstance(e, Exception):
                raise
            self.error = e  # from now on every training forward raises (above)
            if self.head is not None:
                self.head.detail = (
                    f"budget {self.config.budget}; planning failed ({type(e).__name__}: {e}): "
                    "no plan is installed and training forwards raise until slimact.revert"
                )
            raise
        self.show(state_of(module).compiled_plan, "planned on the first training forward")

    def after(self, output: object) -> None:
        pass

    def show(self, plan: CompiledPlan, how: str) -> None:
        """Put the plan in ``slimact.applied``: the strategy's row says how it was planned and
        what it keeps, one row per installed change (each block's choice, the root's plan)
        follows it."""
        if self.head is None:
            return
        self.head.detail = f"budget {self.config.budget}; {how}: {plan.summary()}"
        log = state_of(self.model).applied
        at = next((i for i, c in enumerate(log) if c is self.head), None)
        if at is not None:
            rows = [AppliedChange(c.path, c.action, c.detail, c.skipped) for c in self.installed]
            log[at + 1 : at + 1] = rows

    def undo(self) -> None:
        self.unwatch()
        _undo(self.installed)
        self.installed = []
        self.runtime.remove()
        reset_field(self.model, "compiled_plan")


def apply_compiled_auto(
    model: nn.Module, config: CompiledAutoConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    if config.budget is None:
        raise ValueError(
            "strategy 'compiled-auto' needs a memory budget: 'compiled-auto@25%' (a share of "
            "the eager model's activation bytes) or CompiledAutoConfig(budget='6GiB')"
        )
    if filter_fn is not None:
        raise ValueError("strategy 'compiled-auto' plans every block; filter_fn is not supported")
    refuse_unless_token_ids(model, "compiled-auto", "its planner profiles blocks on token ids")
    if config.host_budget is not None:  # refused at apply, not at the first training forward
        check_model(model)
    _refuse_another_runtime(model)  # one runtime per model, and compiled-auto's is its own
    lazy = _LazyPlanner(model, config)
    if config.batch is not None:
        ids, targets = random_token_batch(
            model, config.batch, config.seq, config.seed, "CompiledAutoConfig"
        )
        lazy.unwatch()
        try:
            lazy.installed = plan_compiled(model, config, ids, targets, runtime=lazy.runtime)
        except BaseException:
            lazy.runtime.remove()
            raise
    what = "planned" if config.batch is not None else "plans on the first training forward"
    head = AppliedChange("", "compiled-auto", f"budget {config.budget}; {what}", undo=lazy.undo)
    lazy.head = head
    if config.batch is not None:
        head.detail += f": {state_of(model).compiled_plan.summary()}"
    # the blocks' rows, for slimact.applied(); the head's undo reverts them
    rows = [AppliedChange(c.path, c.action, c.detail, c.skipped) for c in lazy.installed]
    return [head, *rows]


register_strategy(
    "compiled-auto",
    CompiledAutoConfig(),
    apply_compiled_auto,
    "MILP over torch.compile's region budgets x traced codecs per block (needs a budget)",
    codec_policy=True,  # its plan may give the eager root a codec: no second codec policy
)
