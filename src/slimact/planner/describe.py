"""Every strategy as a ``Plan``: what it does to each saved tensor, read from one measured step.

``auto`` and a loaded ``Plan`` are plans already: after one step the runtime holds the plan it
runs. The fixed-rule strategies decide per site while the step runs: ``int4`` and its variants
and ``prac``/``pac``/``rac`` through a plan of lazy rules (role -> codec, ``SiteRule``) on the
same runtime, ``invact``, ``recompute``, ``cola-m`` and ``chunked-ce`` through rules of their own. So their
plan (and their ``+`` compositions') is *read* here, with the lazy rules where there are any:
one forward+backward of a copy of the model under ``none`` and one under the strategy, both
through the meter, give for every storage of every block

    keep                 saved by the strategy as by ``none``
    codec:<label>        saved through a codec (the meter's label, parameters included)
    recompute            no longer saved: a checkpointed module (the ``recompute`` changes)
                         recomputes it in backward
    reformulate:<op>     no longer saved, or newly saved, because a module was reformulated

with the bytes before (``none``) and after (the strategy) measured, not predicted: the plan's
``predicted_bytes`` is the meter's total under the strategy. Such a plan is a description:
``meta["describes"]`` names the strategy and ``slimact.apply`` refuses it (apply the strategy
itself), since its codec labels may carry per-site parameters that only the strategy's rules
reproduce. ``slimact plan --strategy NAME`` prints it with ``Plan.table``.

A block compiled with its actions inside (``compiled-none`` / ``-int8`` / ``-int4`` /
``-recompute``, ``compiled-auto``; ``slimact.compiled``) saves what its compiled graphs keep, not
what its eager ops would: its eager sites become ``reformulate:compiled`` with 0 bytes (the block
as a whole is ``reformulate:compiled``), and what the graphs save are the meter's
``<block>:compiled#k`` rows, ``keep`` or ``codec:compiled-<codec>`` (the block's traced codec;
the meter tells a payload by its integer dtype, so a codec's fp32 scales show as ``keep``).
The block's kind names its choice, e.g. ``LlamaBlock, compiled recompute/budget=0.5+codec:
compiled-int8``. For ``compiled-auto`` the choices are the plan it solved on the step's batch;
its eager root's codec, if any, shows in the root's rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn

from slimact import actions
from slimact.hf_inputs import lm_loss
from slimact.meter import MemoryReport, measure
from slimact.planner.apply import runtime_of
from slimact.planner.plan import LayerPlan, Plan, rel_site
from slimact.registry import StrategyConfig, applied, apply, resolve
from slimact.state import peek

RECOMPUTING = ("recompute", "cola-m")  # AppliedChange actions that checkpoint their module
COMPILING = "compile"  # the AppliedChange action of a block compiled by slimact.compiled
COMPILED = actions.reformulate("compiled")  # an eager site of a compiled block


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


def _under(module: str, paths: set[str]) -> str | None:
    for p in paths:
        if not p or module == p or module.startswith(p + "."):
            return p
    return None


def _compiled_blocks(model: nn.Module) -> dict[str, str]:
    """block path -> its choice's label (``BlockChoice.label``) for the blocks compiled with
    their actions inside: the ``compile`` changes, and the choices of a plan ``compiled-auto``
    solved on the first training forward (its changes are made then, not at ``apply``)."""
    out = {c.path: c.detail for c in applied(model) if c.action == COMPILING and not c.skipped}
    plan = getattr(peek(model), "compiled_plan", None)
    out.update({path: choice.label for path, choice in getattr(plan, "choices", {}).items()})
    return out


def _compiled_row(action: str, label: str) -> str:
    """A compiled region's save: the meter's ``codec:compiled`` named by the block's codec."""
    codec = next((p for p in label.split("+") if p.startswith(actions.CODEC + ":")), None)
    if codec is not None and action == actions.codec("compiled"):
        return codec
    return action


def describe(
    model: nn.Module,
    strategy: str | StrategyConfig,
    ids: torch.Tensor,
    forward: Forward = ids_loss,
    name: str = "",
) -> Plan:
    """The plan ``strategy`` amounts to on ``model`` for token ids ``ids`` (B, S); ``model`` is
    not changed. Runs one measured step (``forward`` gives the loss) of a copy under ``none``
    and one of a copy under the strategy."""
    spec = strategy if isinstance(strategy, str) else type(strategy).__name__
    resolve(strategy)  # a bad spec fails here, before any copy is made
    base = _step(copy.deepcopy(model), ids, forward)
    work = apply(copy.deepcopy(model), strategy)
    report = _step(work, ids, forward)
    compiled = _compiled_blocks(work)
    runtime = runtime_of(work)
    solved = (
        runtime is not None
        and runtime.plan is not None
        and not runtime.plan.rules
        and runtime.preset_rows is None  # a preset's plan: described from its step, as before
    )
    if solved and not compiled:
        return runtime.plan  # auto / a Plan: the plan it runs (compiled-auto's: its root only)
    rules = runtime.plan.rules if runtime is not None and runtime.plan is not None else ()
    changes = [c for c in applied(work) if not c.skipped and c.path]
    recomputed = {c.path for c in changes if c.action in RECOMPUTING}
    reformed = {
        c.path: c.action
        for c in changes
        if c.action.startswith(("invact:", "invnorm:")) or c.action == "chunked-ce"
    }
    before, after = _owner_rows(base), _owner_rows(report)
    modules = {r.site: r.module for r in (*base.sites, *report.sites)}
    rows: dict[str, list[tuple[str, str, int, int]]] = {}
    for site, (block, _, b) in before.items():
        if site in after:
            action, a = after[site][1], after[site][2]
        elif block in compiled:  # the block's compiled graphs save instead (their own rows)
            action, a = COMPILED, 0
        elif (p := _under(modules[site], set(reformed))) is not None:
            action, a = actions.reformulate(actions.reform_op(reformed[p])), 0
        elif _under(modules[site], recomputed) is not None:
            action, a = actions.RECOMPUTE, 0
        else:  # its storage is now counted under another site (e.g. an input shared anew)
            action, a = actions.KEEP, 0
        rows.setdefault(block, []).append((rel_site(site, block), action, b, a))
    for site, (block, action, a) in after.items():
        if site not in before:  # saved only under the strategy: checkpoint inputs, new ops
            if block in compiled:  # what a compiled block's graphs save: <block>:compiled#k
                action = _compiled_row(action, compiled[block])
            rows.setdefault(block, []).append((rel_site(site, block), action, 0, a))
    named = dict(work.named_modules())
    blocks = {b for b in rows if b}

    def owner(path: str) -> str:  # the block a module belongs to ("" outside the blocks)
        return next((b for b in blocks if path == b or path.startswith(b + ".")), "")

    layers = []
    for block in sorted(rows, key=lambda b: (b != "", b)):
        r = tuple(rows[block])

        def rel(path: str, block: str = block) -> str:
            return rel_site(path, block) if block else path

        mine = {p for p in (*recomputed, *reformed) if owner(p) == block}
        reform = sorted((rel(p), reformed[p]) for p in mine & set(reformed))
        kind = type(named[block]).__name__ if block else "(root)"
        if block in compiled:  # the whole block runs as compiled graphs
            reform = [("", "compiled"), *reform]
            kind = f"{kind}, compiled {compiled[block]}"
        layers.append(
            LayerPlan(
                block=block,
                kind=kind,
                recompute=tuple(sorted(rel(p) for p in mine & recomputed)),
                reform=tuple(p for p, _ in reform),
                storages=r,
                baseline_bytes=sum(x[2] for x in r),
                predicted_bytes=sum(x[3] for x in r),
                reform_kinds=tuple(reform),
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
        rules=rules,
    )


__all__ = ["describe", "ids_loss"]
