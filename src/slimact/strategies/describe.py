"""Every strategy as a measured ``Plan``: the plan it is, applied, with one step's bytes per site.

A strategy that has a plan form is described by that plan, never by guessing from what it
changed:

    none, recompute, int4, invact, ...   ``plan_of`` (``strategies/presets.py``): the preset's
    and their ``+`` compositions         exact plan (``auto@<budget>``: the plan it solves on
                                         the given ids, through the strategy's planner)
    compiled-*                           ``compiled_plan_of`` (``strategies/compiled_presets.py``;
                                         ``compiled-auto``: solved on the given ids; after
                                         compile-safe eager parts, ``invact@ops=none+
                                         compiled-int8``: its eager part)
    a Plan, a CompiledPlan               itself

The plan is applied to a copy of the model (``slimact.apply``, the one plan runtime), and one
forward+backward of that copy runs through the meter; one of another copy under ``none`` gives
each site's bytes before. Every storage of every block gets a row (site, action, bytes before,
bytes after):

    a site the meter sees under the plan   the meter's action (the runtime's own words: keep,
                                           codec:<label> with its parameters, offload)
    a site no longer saved                 from the plan: ``reformulate:<op>`` inside a module it
                                           reformulates, ``recompute`` inside one it recomputes,
                                           else ``keep`` with 0 bytes (its storage is now counted
                                           under another site)

The layers' ``recompute``, ``reform`` and ``reform_kinds``, the plan's lazy rules and its
settings (``Plan.settings``: how its families compute) are the plan's; ``predicted_bytes`` is the meter's total under the plan. The result is a description:
``meta["describes"]`` names the strategy and ``slimact.apply`` refuses it (apply the strategy
or its plan). ``slimact plan --strategy NAME`` prints it with ``Plan.table``.

A compiled block (a ``CompiledPlan``'s choice) saves what its compiled graphs keep, not what its
eager ops would: its eager sites become ``reformulate:compiled`` with 0 bytes (the block as a
whole is ``reformulate:compiled``), and what the graphs save are the meter's
``<block>:compiled#k`` rows, ``keep`` or the block's traced codec (``codec:compiled-<codec>``;
the meter tells a payload by its integer dtype, so a codec's fp32 scales show as ``keep``). The
block's kind names its choice (``BlockChoice.label``), e.g. ``LlamaBlock, compiled
recompute/budget=0.5+codec:compiled-int8``; the root's option, if any, is the root's plan.

A strategy with no plan form (a spec mixing a preset with a compiled strategy, ``auto`` without
a budget) is refused, naming the spec and what can be described. ``cola`` (the architecture,
which changes nothing) is the empty plan: its rows are the model's as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn

from slimact import actions
from slimact.compiled.strategies import CompiledCodecConfig
from slimact.hf_inputs import lm_loss
from slimact.meter import MemoryReport, measure
from slimact.planner.auto import AutoConfig
from slimact.planner.compiled import CompiledPlan
from slimact.planner.plan import LayerPlan, Plan, abs_path, inside, rel_site
from slimact.registry import StrategyConfig, apply, resolve
from slimact.strategies.compiled_auto import CompiledAutoConfig
from slimact.strategies.compiled_presets import CompiledPlanConfig, compiled_plan_of
from slimact.strategies.presets import PRESETS, plan_of, refusal

COMPILED = actions.reformulate("compiled")  # an eager site of a compiled block
_COMPILED_KINDS = (CompiledCodecConfig, CompiledAutoConfig, CompiledPlanConfig)
DESCRIBABLE = (
    "describable are the presets (none, recompute, offload, int4, int4-plain, int4-paper, int4-naive, int8, "
    "invact, invact-act, chunked-ce, prac, pac, rac, cola, cola-m, auto@<budget>) and their '+' "
    "compositions, one compiled strategy (compiled-*, after compile-safe eager parts: invact, "
    "invact-act, chunked-ce, cola), a Plan or a CompiledPlan"
)

Forward = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, token ids) -> loss


def ids_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The loss of ``ids`` scored against themselves (``hf_inputs.lm_loss(model, ids, ids)``):
    what a step saves does not depend on which tokens are the labels."""
    return lm_loss(model, ids, ids)


def _step(model: nn.Module, ids: torch.Tensor, forward: Forward) -> MemoryReport:
    model.zero_grad(set_to_none=True)
    with measure(model) as meter:
        loss = forward(model, ids)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.report


def _owner_rows(report: MemoryReport) -> dict[str, tuple[str, str, int]]:
    """site -> (block, action, bytes) for the sites that own a storage (bytes counted there)."""
    shared = {s for r in report.sites for s in r.shared_with}
    return {r.site: (r.block, r.action, r.bytes) for r in report.sites if r.site not in shared}


def strategy_plan(
    model: nn.Module, strategy: str | StrategyConfig | CompiledPlan, ids: torch.Tensor
) -> Plan | CompiledPlan:
    """The plan ``strategy`` is on ``model`` (module docstring); ``auto`` and ``compiled-auto``
    without a batch shape solve theirs on ``ids`` (scored against themselves). ``model`` is
    left as it was; a strategy with no plan form is a ``ValueError``."""
    configs = resolve(strategy)
    spec = strategy if isinstance(strategy, str) else configs[0].name
    if len(configs) == 1 and isinstance(configs[0], Plan):
        return configs[0]
    compiled = [c for c in configs if isinstance(c, _COMPILED_KINDS)]
    if compiled:  # one, beside compile-safe eager parts (``compiled_plan_of`` refuses others)
        config = compiled[0]
        solves = isinstance(config, CompiledAutoConfig) and config.batch is None
        try:
            return compiled_plan_of(model, strategy, example=(ids, ids) if solves else None)
        except ValueError as e:
            if len(configs) == 1:
                raise
            raise ValueError(
                f"describe({spec!r}): {e}; a strategy is described by its plan: {DESCRIBABLE}"
            ) from e
    for config in configs:
        if type(config) not in PRESETS:
            why = f"{config.name!r} has no plan form"
        elif not (why := refusal(config, None)):
            continue
        raise ValueError(
            f"describe({spec!r}): {why}; a strategy is described by its plan: {DESCRIBABLE}"
        )
    solves = any(isinstance(c, AutoConfig) and c.batch is None for c in configs)
    return plan_of(model, strategy, example=(ids, ids) if solves else None)


def _eager_part(plan: Plan | CompiledPlan) -> tuple[Plan, dict[str, str]]:
    """The plan the eager runtime runs (a compiled plan's: its eager part and its root's
    option, ``CompiledPlan.runtime_plan``) and the compiled blocks, block path -> its choice's
    label."""
    if isinstance(plan, Plan):
        return plan, {}
    return plan.runtime_plan() or Plan(), {p: c.label for p, c in plan.choices.items()}


def _compiled_row(action: str, label: str) -> str:
    """A compiled region's save: the meter's ``codec:compiled`` named by the block's codec."""
    codec = next((p for p in label.split(actions.THEN) if p.startswith(actions.CODEC + ":")), None)
    if codec is not None and action == actions.codec("compiled"):
        return codec
    return action


def _gone(plan: Plan) -> list[tuple[str, str]]:
    """(absolute module path, the action of what it no longer saves): the modules the plan
    reformulates, then those it recomputes (a reformulated module inside a recomputed block is
    named by its reformulation)."""
    reformed = [
        (abs_path(p, lp.block), lp.reform_action(p)) for lp in plan.layers for p in lp.reform
    ]
    recomputed = [
        (abs_path(p, lp.block), actions.RECOMPUTE) for lp in plan.layers for p in lp.recompute
    ]
    return [(path, action) for path, action in (*reformed, *recomputed) if path]


def describe(
    model: nn.Module,
    strategy: str | StrategyConfig | CompiledPlan,
    ids: torch.Tensor,
    forward: Forward = ids_loss,
    name: str = "",
) -> Plan:
    """The plan ``strategy`` is on ``model`` for token ids ``ids`` (B, S), with every site's
    bytes measured (module docstring); ``model`` is not changed. Runs one measured step
    (``forward`` gives the loss) of a copy under ``none`` and one of a copy under the plan."""
    configs = resolve(strategy)  # a bad spec fails here, before any copy is made
    spec = strategy if isinstance(strategy, str) else configs[0].name
    work = copy.deepcopy(model)
    plan = strategy_plan(work, strategy, ids)
    base = _step(copy.deepcopy(model), ids, forward)
    apply(work, plan)
    report = _step(work, ids, forward)
    eager, compiled = _eager_part(plan)
    gone = _gone(eager)
    before, after = _owner_rows(base), _owner_rows(report)
    modules = {r.site: r.module for r in (*base.sites, *report.sites)}
    rows: dict[str, list[tuple[str, str, int, int]]] = {}
    for site, (block, _, b) in before.items():
        if site in after:
            action, a = after[site][1], after[site][2]
        elif block in compiled:  # the block's compiled graphs save instead (their own rows)
            action, a = COMPILED, 0
        else:
            hit = (act for path, act in gone if inside(modules[site], path))
            action, a = next(hit, actions.KEEP), 0
        rows.setdefault(block, []).append((rel_site(site, block), action, b, a))
    for site, (block, action, a) in after.items():
        if site not in before:  # saved only under the plan: checkpoint inputs, new ops
            if block in compiled:  # what a compiled block's graphs save: <block>:compiled#k
                action = _compiled_row(action, compiled[block])
            rows.setdefault(block, []).append((rel_site(site, block), action, 0, a))
    named = dict(work.named_modules())
    layers = []
    for block in sorted(rows, key=lambda b: (b != "", b)):
        r = tuple(rows[block])
        lp = eager.layer(block) or LayerPlan(block=block, kind="")
        reform, reform_kinds = lp.reform, lp.reform_kinds
        kind = type(named[block]).__name__ if block else "(root)"
        if block in compiled:  # the whole block runs as compiled graphs
            reform, reform_kinds = ("", *reform), (("", "compiled"), *reform_kinds)
            kind = f"{kind}, compiled {compiled[block]}"
        layers.append(
            LayerPlan(
                block=block,
                kind=kind,
                recompute=lp.recompute,
                reform=reform,
                storages=r,
                baseline_bytes=sum(x[2] for x in r),
                predicted_bytes=sum(x[3] for x in r),
                reform_kinds=reform_kinds,
            )
        )
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return Plan(
        model=name or type(model).__name__,
        batch=int(ids.shape[0]),
        seq=int(ids.shape[1]) if ids.dim() > 1 else 0,
        dtype=str(dtype).removeprefix("torch."),
        baseline_bytes=base.total_bytes,
        predicted_bytes=report.total_bytes,
        layers=tuple(layers),
        meta=(("describes", spec), ("measured", True)),
        rules=eager.rules,
        settings=eager.settings,
    )


__all__ = ["describe", "ids_loss", "strategy_plan"]
