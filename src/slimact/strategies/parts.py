"""A fixed-rule strategy is a planner: ``(model, config, filter_fn) -> (Plan, rows)``.

Each strategy finds what it would change without changing the model (its *finder*:
``find_recompute``, ``reformulate.find_invact``, ``reformulate.find_chunked_ce``,
``find_colam``; the probes included, under ``sites.probing()``), states it as a ``Plan`` and
reports the rows it reports (skips with their reasons). ``strategies/presets.py`` merges the
parts of a spec into one plan (``plan_of``, ``apply_presets``); a strategy's registered
transform installs its own part (:func:`install_part`), so every fixed-rule strategy changes a
model through the plan runtime's code:

* on the one runtime: a new ``PlanRuntime`` on a model that carries none, or merged into a
  runtime that presets alone made (``PlanRuntime.merge_plan``; reverting puts its plan back);
* beside a planner's runtime: on the part-by-part path (``registry.part_by_part``: a spec with
  a part that is not a preset, ``auto``, ``plan``, ``compiled-*``) or on a model that carries
  a change that is not a preset's (a solved plan), the one runtime is the planner's, whose plan
  is re-solved and swapped whole; a plan that only recomputes and reformulates is then patched
  by the runtime's own patchers without a runtime (``planner.apply.patch_plan``), as the
  strategies always did there. A plan with codecs (``offload``) needs the runtime: its own on
  a model without one, merged into a presets' one, else refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.nn as nn

from slimact import sites
from slimact.actions import FUSED_RMS
from slimact.checkpointing import guard_cache
from slimact.planner.apply import PlanRuntime, patch_plan, put_plan, refuse_second, runtime_of
from slimact.planner.plan import LayerPlan, Plan
from slimact.registry import AppliedChange, part_by_part, register_part_install
from slimact.state import peek

Part = tuple[Plan, list[AppliedChange]]  # a part's plan and the rows the strategy reports


def layers_of(
    model: nn.Module, field: str, paths: list[str], kinds: dict[str, str] | None = None
) -> tuple[LayerPlan, ...]:
    """``paths`` (absolute module paths) as one ``LayerPlan`` per block, ``field`` holding each
    path relative to its block (and ``reform_kinds`` its kind from ``kinds``); paths outside
    every block go to the root's row (block "")."""
    blocks = sites.block_paths(model)
    modules = dict(model.named_modules())
    rows: dict[str, list[tuple[str, str]]] = {}
    for path in paths:
        owner = next((b for b in blocks if path == b or path.startswith(b + ".")), "")
        rel = path[len(owner) + 1 :] if owner and path != owner else ("" if owner else path)
        rows.setdefault(owner, []).append((rel, (kinds or {}).get(path, "")))
    return tuple(
        LayerPlan(
            block=b,
            kind=type(modules[b]).__name__ if b else type(model).__name__,
            **{field: tuple(rel for rel, _ in rows[b])},
            reform_kinds=tuple((rel, k) for rel, k in rows[b] if k),
        )
        for b in [*blocks, ""]
        if b in rows
    )


def reform_part(model: nn.Module, strategy: str, rows: list[AppliedChange], settings) -> Part:
    """A finder's ``rows`` as a plan: the modules it would reformulate as ``reform`` with their
    kinds (the rows' actions: ``invact:silu``, ``chunked-ce``, ``cola-m``, ...), and how they
    compute (``settings``: one family's, ``Plan.settings``)."""
    modules = dict(model.named_modules())
    kinds = {c.path: c.action for c in rows if not c.skipped and c.path and c.path in modules}
    if not kinds:
        return Plan(), rows
    plan = Plan(
        layers=layers_of(model, "reform", list(kinds), kinds),
        meta=(("strategy", strategy),),
        settings={settings.family: settings},
    )
    return plan, rows


def is_empty(plan: Plan) -> bool:
    return not plan.layers and not plan.rules


def presets_runtime(model: nn.Module) -> PlanRuntime | None:
    """The model's runtime where presets alone made it (every change it carries a preset's),
    else None."""
    st, rt = peek(model), runtime_of(model)
    return rt if rt is not None and rt.preset_rows == len(st.applied) else None


def _codecs(plan: Plan) -> bool:
    return bool(plan.rules) or any(lp.codecs for lp in plan.layers)


def finish_rows(
    model: nn.Module,
    plan: Plan,
    out: list[AppliedChange],
    undo: Callable[[], object],
    rt: PlanRuntime | None,
    tail: tuple[AppliedChange, ...] = (),
) -> list[AppliedChange]:
    """The rows of an installed part or spec: the undo on the first that changes something,
    the KV-cache guard where the plan recomputes, then ``tail``; counted on a presets'
    runtime (``preset_rows``)."""
    next(c for c in out if not c.skipped).undo = undo
    if any(lp.recompute for lp in plan.layers):
        guard = guard_cache(model)
        if guard is not None:
            out.append(guard)
    out += tail
    if rt is not None and rt.preset_rows is not None:
        rt.preset_rows += len(out)
    return out


def install_part(
    model: nn.Module, plan: Plan, rows: list[AppliedChange], tail: tuple[AppliedChange, ...] = ()
) -> list[AppliedChange]:
    """A preset's part (``plan``, ``rows``) installed (module docstring): the one installer of
    a strategy applied part by part. The rows come back with the undo on the first one that
    changes something, the runtime's rows for a codec rule after the head row (PRAC's fused
    norms, the codec policy), then the cache guard where the plan recomputes, then ``tail``
    (rows added where it changes something); a plan that changes nothing gives the rows alone."""
    if is_empty(plan):
        return rows
    st, rt = peek(model), runtime_of(model)
    clean = rt is None and (st is None or not st.applied)
    ours = presets_runtime(model)
    ran: list[AppliedChange] = []
    if not _codecs(plan) and (part_by_part() or not (clean or ours is not None)):
        _, undo = patch_plan(model, plan)
        rt = None  # beside the runtime: not one of its parts
    elif rt is None or ours is not None:
        rt, changes, undo = put_plan(model, plan, None if part_by_part() else 0)
        if part_by_part():  # no longer a presets' runtime: the spec's other parts are not
            rt.preset_rows = None
        if plan.rules:  # the runtime's rows for the rule, as on the preset path
            ran = [*(c for c in changes if c.action == FUSED_RMS), changes[-1]]
        elif _codecs(plan):  # a site table (offload's block inputs): the policy's row last
            tail = (*tail, AppliedChange("", "codec-policy", changes[-1].detail))
    else:
        refuse_second(rt, plan)
    out = [dataclasses.replace(c, undo=None) for c in rows]
    if ran:
        out[1:1] = [AppliedChange(c.path, c.action, c.detail) for c in ran]
    return finish_rows(model, plan, out, undo, rt, tail)


register_part_install(install_part)
