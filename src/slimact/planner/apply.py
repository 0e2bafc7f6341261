"""Applying a plan: checkpoint, reformulate and encode exactly what the ``Plan`` says.

``PlanRuntime`` owns everything a plan changes on a model, so a new plan can replace the old one
between steps (adaptive evolution) and ``slimact.revert`` undoes it all:

- **recompute**: each planned module's instance ``forward`` runs under non-reentrant
  ``torch.utils.checkpoint``. Its inputs are saved by the checkpoint *through autograd*, under
  the site role ``checkpoint_input`` (``"<module>:checkpoint_input#k"``), so the meter counts
  them and the codec policy may encode them (a recomputation then starts from the decoded
  input). Nothing is reported with ``sites.hold`` (the save already counts).
- **reformulate**: ``slimact.reformulate`` swaps the planned norms/activations for inverted
  ops, and the loss head for ``chunked-ce``, each with the plan's settings of its family
  (``Plan.setting("invact")``, ``"chunked-ce"``: ``planner.settings``; ``probe=False``: the plan
  already names the modules). A *block reformulation* rewrites a whole block's forward (kind
  ``cola-m``: CoLA-M's two selective checkpoints, ``slimact.cola.colam``); its kind is
  registered by the layer that implements it (``register_block_reform``), applied after the
  module ones. Every recomputation, a recomputed module's and a block reformulation's, keeps
  or drops the RNG state as the plan's ``recompute`` settings say (``preserve_rng_state``).
- **offload** is the codec ``offload`` in the plan's table (``codecs/offload.py``); a plan
  that offloads is refused on a CPU model (its tensors are in host memory already).
- **codecs**: one ``CodecPolicy`` whose ``assign`` looks every site up in the plan's table
  (absolute site name -> codec); one codec instance per (block, storage), built for the tensor's
  channel count, so stateful codecs (PRAC) keep one state per storage and block. Other sites go
  to the plan's lazy rules (``SiteRule``): role (``classify.site_role``) -> the rule's codec, one
  instance per (rule, role, channel count), for the rule's ``modules`` only (``filter_fn`` at
  install written into the rules: ``planner.scope.restrict_rules``). A PRAC rule (``roles="prac"``) goes to the
  runtime's PRAC state (``planner.prac_sites``): per-site decisions, a codec per compressed
  storage, the step clock (advanced per training forward), as ``stateful["prac"]``.

The runtime's root hooks enter the router and the policy around every root forward (the one
way in: a ``CodecPolicy`` of one's own rides an empty plan's runtime, :func:`install_policy`)
and call its *watchers* (:meth:`PlanRuntime.watch`: budget check, evolver, compiled-auto); a
forward on another thread meanwhile is refused (``sites.RootCalls.claim``). *Lazy planning*
(``auto`` without a batch shape) profiles and solves on the first grad-enabled forward's batch,
in a worker thread (thread-local router, hooks and modes: an enclosing ``slimact.measure``
neither sees nor counts it; autocast carried over, the RNG state restored).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, Protocol

import torch
import torch.nn as nn

from slimact import sites
from slimact.checkpointing import checkpoint_module, guard_cache
from slimact.classify import call_batch
from slimact.codecs.offload import check_model
from slimact.codecs.saving import CodecPolicy
from slimact.patching import run_all
from slimact.planner.assign import PlanAssign
from slimact.planner.plan import Plan, abs_path
from slimact.planner.prac_sites import PracPolicy, PracState
from slimact.planner.scope import check_modules, restrict_rules, scope
from slimact.reformulate import (
    FUSED_RMS,
    apply_fused_rms,
    find_head,
    loss_output,
    park_labels,
    patch_chunked_ce,
    patch_invact,
)
from slimact.registry import AppliedChange
from slimact.state import peek, prune, state_of
from slimact.utils import PLANNER_THREAD, in_worker_thread, refuse_compiled_call

_tls = threading.local()

# reformulation kind -> fn(block, preserve_rng_state) -> undo, for kinds that rewrite a whole
# block's forward, registered from above (``strategies/cola.py``: ``cola-m``)
BlockReform = Callable[[nn.Module, bool], Callable[[], None]]
_BLOCK_REFORMS: dict[str, BlockReform] = {}


def register_block_reform(kind: str, fn: BlockReform) -> None:
    """Let plans reformulate a block with ``kind``: ``fn(block, preserve_rng_state)`` rewrites it
    in place, its recomputations keeping the RNG state or not as the plan's ``recompute``
    settings say (raising ``ValueError`` with the reason where it cannot), and returns the
    function that undoes it."""
    _BLOCK_REFORMS[kind] = fn


class PolicySites:
    """The runtime's codec-policy site states as checkpointable strategy state
    (``ModelState.stateful["codec-sites"]``: ``CodecPolicy.site_state_dict``), so that a resumed
    run stores each site as the uninterrupted run does (deferred or checked, outlier
    capacities). Loaded before a plan is installed (a lazy plan's checkpoint), they wait for it."""

    def __init__(self, runtime: PlanRuntime) -> None:
        self.runtime = runtime
        self.pending: dict[str, dict] = {}

    def state_dict(self) -> dict[str, dict]:
        policy = self.runtime.policy
        return policy.site_state_dict() if policy is not None else dict(self.pending)

    def load_state_dict(self, states: dict[str, dict]) -> None:
        if self.runtime.policy is not None:
            self.runtime.policy.load_site_state_dict(states)
        else:
            self.pending = dict(states)


class RootWatcher(Protocol):
    """What watches a plan's root calls through its runtime (``PlanRuntime.watch``)."""

    def before(self, args: tuple, kwargs: dict) -> None: ...

    def after(self, output: Any) -> None: ...


def _unwatch(watchers: list[RootWatcher], watcher: RootWatcher) -> None:
    watchers[:] = [w for w in watchers if w is not watcher]


def _close_call(entry: tuple[ExitStack | None, bool]) -> None:
    """Close what an interrupted root call left entered (``sites.RootCalls``)."""
    if entry[0] is not None:
        entry[0].close()


class PlanRuntime:
    """Installs a plan on ``model`` and swaps it for another on demand (see module docstring)."""

    def __init__(self, model: nn.Module, planner: Callable[..., Any] | None = None) -> None:
        self.model = model
        self.planner = planner
        self.plan: Plan | None = None
        self.profile = None  # the Profile the plan was solved from (lazy planning sets it)
        self.solve_options: dict[str, Any] = {}
        self.observer: Callable[[str, torch.Tensor], None] | None = None
        self.assign: PlanAssign | None = None
        self.policy: CodecPolicy | None = None
        self._undo: list[Callable[[], None]] = []
        # per root call: what ``_pre`` entered (router and policy) and whether it parked the
        # label for the head; closed by ``_post``, or at the next call if a BaseException skipped it
        self._calls = sites.RootCalls(_close_call)
        self._head_planned = False
        self.history: list[dict] = []
        self.last_input: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.preset_rows: int | None = None  # a preset's runtime: the changes its applies made
        self.watchers: list[RootWatcher] = []  # newest first (``watch``)
        self._hooks = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, always_call=True),
        ]
        state_of(model).runtime = self
        self.sites = state_of(model).stateful["codec-sites"] = PolicySites(self)

    # -- plans --------------------------------------------------------------------------------
    def set_plan(self, plan: Plan, filter_fn: Callable[[nn.Module, str], bool] | None = None):
        """Undo the current plan's patches and install ``plan``'s; returns the change list.
        ``filter_fn``: only the blocks it accepts, and the rules restricted to the modules it
        accepts (``restrict_rules``: written into the installed plan, ``self.plan``)."""
        modules = dict(self.model.named_modules())
        known = {lp.block for lp in plan.layers}
        missing = sorted(b for b in known if b and b not in modules)
        if missing:
            raise ValueError(
                f"plan for {plan.model!r} names blocks {missing[:3]} this model does not have; "
                f"its blocks are {sites.block_paths(self.model)[:3]}..."
            )
        for rule in plan.rules:
            absent = [p for p in rule.modules or () if p not in modules]
            if absent:
                raise ValueError(
                    f"plan for {plan.model!r} has a rule ({rule.describe()}) for modules "
                    f"{absent[:3]} this model does not have"
                )
        if any(c.startswith("offload") for lp in plan.layers for c, _ in lp.codecs):
            check_model(self.model)  # CUDA only: refused here
        self._clear_patches()
        plan = restrict_rules(plan, self.model, filter_fn)
        allowed = {
            lp.block for lp in plan.layers
            if filter_fn is None or filter_fn(modules[lp.block] if lp.block else self.model, lp.block)
        }  # fmt: skip
        kept = tuple(lp for lp in plan.layers if lp.block in allowed)
        plan = dataclasses.replace(plan, layers=kept) if len(kept) != len(plan.layers) else plan
        changes, undos, self._head_planned = _patched(self.model, plan)
        self._undo.extend(undos)
        old = self.assign
        self.plan = plan
        self.assign = PlanAssign(plan, self)
        if old is not None:  # keep codec instances (and their state) where the codec is unchanged
            for key, codec in old.codecs.items():
                names = {c for c, k in self.assign.table.values() if k == key}
                if names == {c for c, k in old.table.values() if k == key}:
                    self.assign.codecs[key] = codec
            if old.rules == plan.rules:
                self.assign.rule_codecs = old.rule_codecs
        self._set_prac(plan, old)
        if self.assign.prac is not None:
            self.policy = PracPolicy(self.assign.prac, self.assign, carry=self.policy)
        else:
            self.policy = CodecPolicy(self.assign, carry=self.policy)
        if self.sites.pending:
            self.policy.load_site_state_dict(self.sites.pending)
            self.sites.pending = {}
        detail = f"{len(self.assign.table)} site(s) through codecs"
        for rule in plan.rules:
            detail += f"; rule {rule.describe()}"
        changes.append(AppliedChange("", "codec-policy", detail))
        return changes

    def _set_prac(self, plan: Plan, old: PlanAssign | None) -> None:
        """A PRAC rule's state (``planner.prac_sites``): the codecs, one per compressed storage,
        and their step clock, kept across plans with the same rule; checkpointed as
        ``stateful["prac"]`` (``prac_report``, DDP's subspace sync and checkpoints find it)."""
        rules = [r for r in plan.rules if r.roles == "prac"]
        if len(rules) > 1:
            raise ValueError("a plan carries at most one PRAC rule")
        stateful = state_of(self.model).stateful
        prev = old.prac if old is not None else None
        if not rules:
            if prev is not None and stateful.get("prac") is prev:
                del stateful["prac"]
            return
        if prev is not None and prev.rule == rules[0]:
            self.assign.prac = prev
            return
        if stateful.get("prac") not in (None, prev):
            raise ValueError(
                f"a PRAC-family strategy ({stateful['prac'].name}) is already applied to this "
                f"model; revert it before installing a plan with a PRAC rule"
            )
        self.assign.prac = PracState(self.model, rules[0])
        stateful["prac"] = self.assign.prac

    def _clear_patches(self) -> None:
        self._head_planned = False
        while self._undo:
            self._undo.pop()()

    @property
    def bare(self) -> bool:
        """No plan, no planner, no watcher: a runtime that enters nothing (compiled-auto's,
        whose plan keeps the root as it is), which ``install`` takes as the model's."""
        return self.plan is None and self.planner is None and not self.watchers

    def unset(self) -> None:
        """Take the plan off, the runtime staying (with no plan, it enters nothing)."""
        self._clear_patches()
        prac = self.assign.prac if self.assign is not None else None
        if prac is not None and state_of(self.model).stateful.get("prac") is prac:
            del state_of(self.model).stateful["prac"]
        self.plan = self.assign = self.policy = None

    def remove(self) -> None:
        """Undo every patch and hook (what ``slimact.revert`` calls)."""
        self.unset()
        for h in self._hooks:
            h.remove()
        # a root call interrupted by a BaseException (Ctrl-C) never ran ``_post`` (torch runs
        # always_call hooks for an Exception only): close the router and policy it left entered
        self._calls.close_all()
        state_of(self.model).runtime = None
        state_of(self.model).stateful.pop("codec-sites", None)
        prune(self.model)

    # -- lazy planning ------------------------------------------------------------------------
    def plan_now(self, input_ids: torch.Tensor, targets: torch.Tensor | None) -> Plan:
        """Run the planner on this batch in a worker thread (see the module docstring)."""
        if self.planner is None:
            raise ValueError("this runtime has no planner; pass a Plan to set_plan")

        def work() -> Plan:
            _tls.busy = True
            plan = self.planner(input_ids, targets)
            if isinstance(plan, tuple):
                plan, self.profile = plan
            return plan

        return in_worker_thread(work, input_ids.device.type)

    # -- hooks --------------------------------------------------------------------------------
    def watch(self, watcher: RootWatcher) -> Callable[[], None]:
        """``watcher.before(args, kwargs)`` before each root call enters the plan (a plan it
        installs serves that call), ``watcher.after(output)`` once the plan is closed, also after
        an ``Exception``: newest first in, last out, each ``after`` run even when one raises;
        not for a probe's or the planner thread's forwards. Returns the undo."""
        self.watchers.insert(0, watcher)
        return functools.partial(_unwatch, self.watchers, watcher)

    def _watching(self) -> list[RootWatcher]:
        if sites.is_probing() or threading.current_thread().name == PLANNER_THREAD:
            return []
        return list(self.watchers)

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        refuse_compiled_call(self.model)  # this hook under dynamo: the root compiled after apply
        # one call at a time (what it enters is the runtime's): another thread's is refused
        self._calls.claim((None, False), type(self.model).__name__, PLANNER_THREAD)
        if getattr(_tls, "busy", False):  # the planner's own forwards, for a call that waits
            return None
        for watcher in self._watching():
            watcher.before(args, kwargs)
        if sites.is_probing():
            return None
        ids, tgt = call_batch(self.model, args, kwargs)
        if isinstance(ids, torch.Tensor) and self.planner is not None:  # lazy planning's
            self.last_input = (ids, tgt)
        lazy = self.plan is None and self.planner is not None
        if lazy and torch.is_grad_enabled() and isinstance(ids, torch.Tensor):
            changes = self.set_plan(self.plan_now(ids, tgt))
            state_of(self.model).applied.extend(
                AppliedChange(c.path, c.action, c.detail) for c in changes
            )
        # the reformulated head's root part, here rather than in the root override, which a
        # plan installed during this call (lazy planning, a re-plan) would miss
        parked = park_labels(self.model, args, kwargs) if self._head_planned else None
        if self.policy is None or not self.routes_saves():
            self._calls.replace((None, parked is not None))
            return parked
        stack = ExitStack()
        stack.enter_context(sites.tracking(self.model))
        stack.enter_context(sites.policy(self.policy))
        self._calls.replace((stack, parked is not None))
        self.policy.reset()
        return parked

    def merge_plan(self, plan: Plan) -> tuple[list[AppliedChange], Callable[[], None]]:
        """Install the current plan merged with ``plan`` (``Plan.merge``: a conflict is refused
        before anything changes; another failure puts the current plan back). Returns the changes
        and an undo that puts the current plan (and the count of preset rows) back."""
        old, rows = self.plan, self.preset_rows
        merged = old + plan
        try:
            changes = self.set_plan(merged)
        except BaseException:
            self.set_plan(old)
            raise
        return changes, functools.partial(self._unmerge, old, rows)

    def _unmerge(self, old: Plan, rows: int | None) -> None:
        self.set_plan(old)
        self.preset_rows = rows

    def routes_saves(self) -> bool:
        """Does this call need the router and the policy? Not for a preset's plan that only
        recomputes and reformulates (no table, no rules): it decides no save, and nothing
        (budget check, evolver) reads the router on such a runtime."""
        a = self.assign
        if a is None:  # no plan yet: it routes saves where a planner solves one on this call
            return self.planner is not None
        if self.preset_rows is None or self.observer is not None:
            return True
        return bool(a.table or a.rules)

    def _post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if (entry := self._calls.pop()) is sites.REFUSED:  # refused by ``_pre``: entered nothing
            return None
        with ExitStack() as after:  # the watchers' ``after``, oldest first, each one run
            for watcher in self._watching():
                after.callback(watcher.after, output)
            stack, parked = entry or (None, False)
            if stack is not None:
                stack.close()
                if self.policy is not None:
                    self.policy.end()  # its verdicts start for the host (``codecs.saving``)
            if parked:
                return loss_output(self.model, output)
            return None


def _patched(
    model: nn.Module, plan: Plan
) -> tuple[list[AppliedChange], list[Callable[[], None]], bool]:
    """Patch what ``plan`` recomputes and reformulates: (the changes, their undos in order, is
    the loss head reformulated?); where a patch fails, earlier ones are undone and it raises."""
    modules = dict(model.named_modules())
    changes: list[AppliedChange] = []
    undos: list[Callable[[], None]] = []
    targets: set[str] = set()
    kinds: dict[str, str] = {}
    rng = plan.setting("recompute").preserve_rng_state
    check_modules(plan, modules, set(_BLOCK_REFORMS))
    try:
        for lp in plan.layers:
            for path in lp.recompute:
                undos.append(checkpoint_module(modules[full := abs_path(path, lp.block)], rng))
                changes.append(AppliedChange(full, "recompute"))
            targets.update(abs_path(p, lp.block) for p in lp.reform)
            kinds.update((abs_path(p, lp.block), k) for p, k in lp.reform_kinds)
        head = find_head(model)[0]
        if targets:
            done = _reformulate(model, targets, kinds, plan)
            changes += done
            undos += [c.undo for c in done if c.undo is not None]
    except BaseException:
        run_all(*reversed(undos))
        raise
    return changes, undos, bool(targets) and head in targets


def patch_plan(model: nn.Module, plan: Plan) -> tuple[list[AppliedChange], Callable[[], None]]:
    """Patch what ``plan`` recomputes and reformulates as a runtime would, without one: no root
    hooks, no codecs (a plan with a site table or rules is refused). For a preset's plan on a
    model whose one runtime is a planner's (``strategies/presets.py``: the part-by-part path).
    Returns the changes and the undo of them all."""
    if plan.rules or any(lp.codecs for lp in plan.layers):
        raise ValueError("patch_plan patches recomputations and reformulations, not codecs")
    changes, undos, _ = _patched(model, plan)
    return changes, functools.partial(run_all, *reversed(undos))


def _reformulate(
    model: nn.Module, targets: set[str], kinds: dict[str, str], plan: Plan
) -> list[AppliedChange]:
    """Swap the planned modules: the loss head (``chunked-ce``), activations and norms
    (inverted ops), each with the plan's settings of its family, RMSNorms saving (x, rstd)
    (kind ``rms-norm``: PRAC's fused norms); ``probe=False`` since the plan names them."""
    head = find_head(model)[0]
    done: list[AppliedChange] = []
    if head in targets:
        done += patch_chunked_ce(model, plan.setting("chunked-ce").config(probe=False))
    fused = {p for p in targets if kinds.get(p) == FUSED_RMS} - {head}
    if fused:
        done += apply_fused_rms(model, fused)
    blocks = {p for p in targets if kinds.get(p) in _BLOCK_REFORMS} - {head}
    rest = targets - {head} - fused - blocks
    if rest:
        config = plan.setting("invact").config(probe=False)
        done += patch_invact(model, config, lambda m, p: p in rest)
    if blocks:
        rng = plan.setting("recompute").preserve_rng_state
        done += _reform_blocks(model, sorted(blocks), kinds, done, rng)
    applied = [c for c in done if not c.skipped]
    missing = targets - {c.path for c in applied}
    if missing:
        for c in reversed(applied):
            if c.undo is not None:
                c.undo()
        raise ValueError(f"plan reformulates {sorted(missing)}, which cannot be reformulated")
    return applied


def _reform_blocks(
    model: nn.Module, paths: list[str], kinds: dict[str, str], done: list[AppliedChange], rng: bool
) -> list[AppliedChange]:
    """The block reformulations (``register_block_reform``), after the module ones; where
    one refuses its block, everything reformulated so far is undone and the reason raised."""
    modules = dict(model.named_modules())
    out: list[AppliedChange] = []
    for path in paths:
        try:
            undo = _BLOCK_REFORMS[kinds[path]](modules[path], rng)
        except ValueError as e:
            for c in reversed([*done, *out]):
                if not c.skipped and c.undo is not None:
                    c.undo()
            raise ValueError(f"plan reformulates {path!r} as {kinds[path]}: {e}") from e
        out.append(AppliedChange(path, kinds[path], undo=undo))
    return out


def runtime_of(model: nn.Module) -> PlanRuntime | None:
    return st.runtime if (st := peek(model)) is not None else None


def refuse_second(rt: PlanRuntime, plan: Plan | None, planner: object = None) -> None:
    """A plan installed whole (``plan``, or a ``planner``'s) beside ``rt``'s: refused, naming
    what each acts on."""
    raise ValueError(
        f"model already carries a slimact plan ({scope(rt.plan, not rt.bare)}), and another "
        f"({scope(plan, planner)}) is installed whole, not beside it: slimact.revert(model) "
        "first, or merge the two plans into one (plan_a + plan_b)"
    )


def put_plan(
    model: nn.Module, plan: Plan, preset_rows: int | None = None
) -> tuple[PlanRuntime, list[AppliedChange], Callable[[], object]]:
    """``plan`` on the model's one runtime: merged into the one it carries, or on a new one
    (``preset_rows``: 0 for a runtime presets alone make). Returns the runtime, its rows for the
    plan and the undo (the runtime removed, or its old plan put back)."""
    if (rt := runtime_of(model)) is not None:
        return rt, *rt.merge_plan(plan)
    rt = PlanRuntime(model)
    rt.preset_rows = preset_rows
    try:
        return rt, rt.set_plan(plan), rt.remove
    except BaseException:
        rt.remove()
        raise


def watched_runtime(
    model: nn.Module, watcher: RootWatcher
) -> tuple[PlanRuntime, Callable[[], None]]:
    """A new runtime with no plan, watched by ``watcher`` (compiled-auto's pending plan, which
    installs the plan it solves on it: ``install(runtime=...)``); and the unwatch."""
    rt = PlanRuntime(model)
    return rt, rt.watch(watcher)


def install_policy(model: nn.Module, policy: CodecPolicy) -> AppliedChange:
    """Route ``model``'s saves through ``policy``, a ``CodecPolicy`` of one's own (a study's, a
    test's, a strategy's fixed rule), on a plan runtime with an empty plan: the runtime's root
    entry is the one way into the router. Returns the undoable change; a model that already
    carries a runtime is refused (compose through its plan instead)."""
    if runtime_of(model) is not None:
        raise ValueError(
            "model already carries a slimact runtime: add to its plan, or slimact.revert first"
        )
    rt = PlanRuntime(model)
    rt.set_plan(Plan(meta=(("policy", type(policy).__name__),)))
    rt.policy = policy
    return AppliedChange(path="", action="codec-policy", undo=rt.remove)


def install(
    model: nn.Module,
    plan: Plan | None = None,
    planner: Callable[..., Any] | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    profile: Any = None,
    solve_options: dict[str, Any] | None = None,
    runtime: PlanRuntime | None = None,
) -> list[AppliedChange]:
    """Put a runtime on ``model`` with ``plan`` (or a lazy ``planner`` returning (plan,
    profile)); ``profile``/``solve_options`` let ``PlanEvolver`` re-solve. One undoable change.
    ``runtime``: the model's own runtime, still without a plan, takes ``plan`` instead (one
    a watcher plans for on the first training forward, compiled-auto's), as a ``bare`` one
    does; the undo takes the plan back off it."""
    existing = runtime_of(model)
    runtime = existing if runtime is None and existing is not None and existing.bare else runtime
    own = runtime is not None
    if own and (existing is not runtime or runtime.plan is not None or planner):
        raise ValueError("install(runtime=...) takes the model's runtime, still without a plan")
    if not own and existing is not None:
        refuse_second(existing, plan, planner)
    rt = runtime if own else PlanRuntime(model, planner)
    rt.profile, rt.solve_options = profile, dict(solve_options or {})
    changes: list[AppliedChange] = []
    try:
        if plan is not None:
            changes = rt.set_plan(plan, filter_fn)
    except Exception:
        rt.unset() if own else rt.remove()
        raise
    detail = "lazy: plans on the first training forward" if plan is None else plan.budget
    head = AppliedChange("", "plan", detail, undo=rt.unset if own else rt.remove)
    # HF: use_cache=False in training; not for a fixed plan recomputing nothing (compiled-auto's
    # root), which with no planner or profile to re-solve from is never swapped for one that does
    fixed = plan is not None and planner is None and profile is None
    recomputes = plan is None or any(lp.recompute for lp in plan.layers)
    guard = None if fixed and not recomputes else guard_cache(model, "planned recomputation")
    return [
        head,
        *([guard] if guard else []),
        *(AppliedChange(c.path, c.action, c.detail) for c in changes),
    ]
