"""Strategy ``graph``: the model's root forward and loss compiled as one graph, from the plan of
the exact parts before it, with one fixed codec (``int8``, ``int4``) or as ``auto@<b>`` solves
it (``planner/graph.py``).

``slimact.apply(model, "invact+recompute", compile=True)`` applies ``"invact+recompute+graph"``
(``registry.compile_form``, by ``planner.graph.graph_form``): the eager parts' merged ``plan_of``
lowered into one compiled graph (``planner.graph.lower``) on a model that carries no slimact
change. Written by hand, ``graph`` is the last part of such a spec; any other use (a ``filter_fn``,
a model with earlier changes, a part that is neither exact nor one lowered codec) is refused,
naming the per-block form.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.nn as nn

from slimact import spec
from slimact.hf_inputs import random_token_batch
from slimact.planner.auto import AutoConfig, plan_model
from slimact.planner.graph import (
    EXACT,
    LOWERS,
    NAME,
    graph_form,
    is_graph,
    lower,
    lower_on_first_batch,
    one_graph_ok,
)
from slimact.planner.plan import Plan
from slimact.registry import (
    AppliedChange,
    FilterFn,
    StrategyConfig,
    applied_strategies,
    register_graph_form,
    register_preset_path,
    register_strategy,
    resolve,
)
from slimact.state import peek
from slimact.strategies.auto import refuse_unless_lm
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
    auto = len(eager) == 1 and isinstance(eager[0], AutoConfig)
    codecs = [c for c in eager if c.name in LOWERS]
    if len(codecs) > 1 or any(c != resolve(c.name)[0] for c in codecs):
        return None  # two codecs, or one with settings: not lowered (``graph_form``)
    eager = [c for c in eager if c not in codecs]
    if not auto and any(c.name not in EXACT or isinstance(c, GraphConfig) for c in eager):
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
    if auto:
        return _auto(model, eager[0])
    if eager:
        plan, rows = plan_and_rows(model, eager)
    else:
        plan, rows = Plan(), []
    changes = lower(model, plan, LOWERS[codecs[0].name] if codecs else None)
    skipped = [c for c in rows if c.skipped]
    return [*changes, *skipped]


def _plan_auto(model: nn.Module, config: AutoConfig, ids, targets) -> Plan:
    was = model.training
    model.train()
    try:
        return plan_model(model, config, ids, targets)
    finally:
        model.train(was)


def _auto(model: nn.Module, config: AutoConfig) -> list[AppliedChange]:
    """``auto@<b>+graph``: the plan ``auto`` solves (``plan_model``: on the first training
    batch, or at once on random tokens of the spec's ``batch`` x ``seq``), lowered as one graph
    with its per-site codecs per module (``compiled.site_codecs``)."""
    refuse_unless_lm(model)
    planner = functools.partial(_plan_auto, model, config)
    if config.batch is None:
        return lower_on_first_batch(model, planner)
    batch = random_token_batch(model, config.batch, config.seq, config.seed, "AutoConfig")
    return lower(model, planner(*batch))


register_strategy(
    NAME,
    GraphConfig(),
    apply_graph,
    "compile the root forward and loss as one graph from the exact parts' plan",
)
register_preset_path(apply_graph_spec)
register_graph_form(graph_form)

__all__ = ["GraphConfig", "apply_graph", "apply_graph_spec"]
