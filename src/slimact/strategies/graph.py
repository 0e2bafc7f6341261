"""Strategy ``graph``: the model's root forward and loss compiled as one graph, from the plan of
the exact parts before it (``planner/graph.py``).

``slimact.apply(model, "invact+recompute", compile=True)`` applies ``"invact+recompute+graph"``
(``registry.compile_form``, by ``planner.graph.graph_form``): the eager parts' merged ``plan_of``
lowered into one compiled graph (``planner.graph.lower``) on a model that carries no slimact
change. Written by hand, ``graph`` is the last part of such a spec; any other use (a ``filter_fn``,
a model with earlier changes, a part that is not exact) is refused, naming the per-block form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from slimact import spec
from slimact.planner.graph import EXACT, NAME, graph_form, is_graph, lower, one_graph_ok
from slimact.planner.plan import Plan
from slimact.registry import (
    AppliedChange,
    FilterFn,
    StrategyConfig,
    applied_strategies,
    register_graph_form,
    register_preset_path,
    register_strategy,
)
from slimact.state import peek
from slimact.strategies.presets import plan_and_rows


@dataclass(frozen=True)
class GraphConfig(StrategyConfig):
    """The root compiled as one graph from the plan of the exact parts before it."""


def _refused(why: str) -> ValueError:
    return ValueError(
        f"strategy {NAME!r} compiles the whole model as one graph from the plan of the parts "
        f"before it ({', '.join(EXACT)}) on a model without other slimact changes; {why}. "
        "compiled-none / compiled-recompute compile each block instead"
    )


def apply_graph(model: nn.Module, config: GraphConfig, filter_fn=None) -> list[AppliedChange]:
    """``graph`` applied part by part: only as the whole spec (``apply_graph_spec``)."""
    raise _refused("here it came part by part (a filter_fn, earlier changes, or other parts)")


def apply_graph_spec(
    model: nn.Module, configs: list[StrategyConfig], filter_fn: FilterFn | None
) -> list[AppliedChange] | None:
    """``slimact.apply`` of ``<exact parts>+graph``: their merged plan lowered as one graph;
    None (nothing changed) for a spec without ``graph`` last or with a ``filter_fn``."""
    if not configs or not isinstance(configs[-1], GraphConfig) or filter_fn is not None:
        return None
    eager = configs[:-1]
    if any(c.name not in EXACT for c in eager) or any(isinstance(c, GraphConfig) for c in eager):
        return None
    if not one_graph_ok(model):
        raise _refused("a Hugging Face model does not run as one graph yet")
    if is_graph(model):  # compiled once: the same spec again is a repeat, another one refused
        before = applied_strategies(model)
        if spec.names(spec.join(before)) != [c.name for c in configs]:
            raise _refused(f"this model is already one graph of {spec.join(before)!r}")
        return [AppliedChange("", "compile-graph", "already one graph", skipped=True)]
    st = peek(model)
    if st is not None and (st.applied or st.runtime is not None or st.stateful):
        return None
    eager = [c for c in eager if c.name != "none"]
    if eager:
        plan, rows = plan_and_rows(model, eager)
    else:
        plan, rows = Plan(), []
    changes = lower(model, plan)
    skipped = [c for c in rows if c.skipped]
    return [*changes, *skipped]


register_strategy(
    NAME,
    GraphConfig(),
    apply_graph,
    "compile the root forward and loss as one graph from the exact parts' plan",
)
register_preset_path(apply_graph_spec)
register_graph_form(graph_form)

__all__ = ["GraphConfig", "apply_graph", "apply_graph_spec"]
