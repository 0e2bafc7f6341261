"""Which modules a plan acts on: a ``filter_fn`` written into its rules (``restrict_rules``),
what it acts on in one line (``scope``: the runtime's error for a second plan names it), and
what keeps it from holding on a model as it is beyond what ``Plan.merge`` sees between two
plans (``check_modules``: a module it recomputes inside a block slimact compiled).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.nn as nn

from slimact import sites
from slimact.planner.plan import Plan, abs_path


def scope(plan: Plan | None, pending: object = None) -> str:
    """What ``plan`` acts on, in a line: its rules' modules and the blocks it changes (None:
    ``pending``, a planner's plan for every module, still to be solved, or no plan)."""
    if plan is None:
        return "a planner's, solved for every module" if pending else "none"
    out = [
        f"rule {r.describe()} for "
        + ("every module" if r.modules is None else ", ".join(r.modules[:3]) or "no module")
        for r in plan.rules
    ]
    blocks = [lp.block or "(root)" for lp in plan.layers if lp.recompute or lp.reform or lp.codecs]
    if blocks:
        out.append(f"actions in {', '.join(blocks[:3])}{', ...' if len(blocks) > 3 else ''}")
    return "; ".join(out) or "an empty plan"


def check_modules(plan: Plan, modules: dict[str, nn.Module], whole_kinds: set[str]) -> None:
    """Refuse a module ``plan`` recomputes that the model does not have, and a module
    recomputed, or a block rewritten whole, inside a block slimact compiled: its forward is one
    compiled graph, which compile's region budget checkpoints instead (``whole_kinds``: the
    reformulation kinds that rewrite a whole block)."""
    done = [p for p, m in modules.items() if sites.sealed(m)]
    for lp in plan.layers:
        whole = [p for p, k in lp.reform_kinds if k in whole_kinds]
        for path, verb in [(p, "recomputes") for p in lp.recompute] + [
            (p, "rewrites") for p in whole
        ]:
            full = abs_path(path, lp.block)
            if verb == "recomputes" and full not in modules:
                raise ValueError(f"plan recomputes {full!r}, which is not a module of the model")
            block = next((b for b in done if full == b or full.startswith(b + ".")), None)
            if block is not None:
                raise ValueError(
                    f"the plan {verb} {full or 'the model'}, in block {block}, which slimact "
                    "compiled (one graph, recomputed by compile's region budget instead): "
                    "slimact.revert(model) first (a compiled block recomputes at region budget "
                    "0, e.g. 'compiled-int8@0')"
                )


def restrict_rules(
    plan: Plan, model: nn.Module, filter_fn: Callable[[nn.Module, str], bool] | None
) -> Plan:
    """``plan`` with each lazy rule restricted to the modules of ``model`` that ``filter_fn``
    accepts (``SiteRule.within``: a rule with ``modules`` keeps those of them it accepts);
    ``plan`` itself without a ``filter_fn`` or without rules."""
    if filter_fn is None or not plan.rules:
        return plan
    paths = [p for p, m in model.named_modules() if filter_fn(m, p)]
    return dataclasses.replace(plan, rules=tuple(r.within(paths) for r in plan.rules))
