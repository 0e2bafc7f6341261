"""One graph for the whole step: the root forward and its loss compiled together from a ``Plan``.

``compile=True`` of an exact spec (:data:`EXACT`: ``none``, ``recompute``, ``invact``,
``invact-act``, ``chunked-ce`` and their ``+`` compositions), of one of them with one fixed codec
(:data:`CODECS`: ``int8``) compiles the model's root forward, the loss included, as one
``torch.compile`` frame: one forward graph and one backward graph per training step, nothing
eager between them but the optimizer. :func:`graph_form` is the one place
that decides it (its docstring states the rule); any other spec (``prac``, ``offload``, a codec
with settings such as ``int8@sr``, ``int4``, ``auto@<b>``) keeps the per-block compiled path
(``compiled.blocks``). ``auto@<b>+graph``, written as such, lowers auto's plan as one graph.

The same per-site ``Plan`` eager uses is lowered (:func:`lower`):

- **reformulations** (inverted activations and norms, the chunked loss head) are patched as the
  plan runtime patches them (``planner.apply.patch_plan``); their ops are ``torch.library``
  custom ops or traceable autograd Functions, so they trace into the graph;
- **recompute and keep** become per-op selective-checkpoint tags: each block (or root module)
  the plan recomputes in runs inside one non-reentrant ``torch.utils.checkpoint`` region with a
  ``create_selective_checkpoint_contexts`` policy (:class:`SitePolicy`), which the compiler honours
  per op. An op inside a module the plan recomputes is ``PREFER_RECOMPUTE``; any other op in the
  region is kept: ``MUST_SAVE`` for the ops a recomputation would pay for (matmuls, attention,
  slimact's custom ops), ``PREFER_SAVE`` for the rest, which the partitioner may still rebuild
  from a saved neighbour by fusion. The op's module is read from the node's ``nn_module_stack``
  (dynamo's metadata, preserved while AOTAutograd traces the region). Ops of modules the plan
  keeps whole, outside any region, are the compiler's default partition: what backward reads,
  pointwise ops fused away where cheaper. What the compiler fuses away differs from eager's saves
  in that way only: decomposed norms save their fp32 statistics, not the eager op's inputs.

- **codecs** become traced saved-tensor hooks (``compiled/codec.py``) entered around the root's
  compiled call, so AOTAutograd inlines the pack into the forward graph and the unpack into the
  backward for every tensor the graph saves (the shape rules and SDPA's roles as per block). A
  fixed codec (``int8``) codes every save; a plan's per-site codecs (``auto@<b>``, solved on the
  first training batch: :func:`lower_on_first_batch`) pick each save's codec by the modules of
  the node that made it and of its readers (``compiled/site_codecs.py``). Selective-checkpoint
  regions that recompute SDPA save its RNG state, which the hooks' inlining looks up by name
  (``compiled/rng_names.py``).

The meter reads the graph's saves off its ``CompiledFunctionBackward`` node behind the root's
output (``:compiled#k``, the root's sites): coded ones at their coded bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch._dynamo import config as dynamo_config
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from slimact import sites, spec
from slimact.compiled.blocks import BACKEND_VARIABLE, RECOMPILE_LIMIT, own_code
from slimact.compiled.codec import codec_hooks
from slimact.compiled.rng_names import matched_rng_names
from slimact.compiled.site_codecs import SiteCodecs, site_hooks, traced_label, widest
from slimact.hf_inputs import hf_model_of, is_hf_model
from slimact.patching import NotCopyable, override_forward, run_all
from slimact.planner.apply import patch_plan
from slimact.planner.plan import Plan, abs_path, abs_site, site_module
from slimact.registry import AppliedChange
from slimact.state import peek

NAME = "graph"  # the strategy that compiles the root as one graph (``strategies/graph.py``)
# the strategies whose actions the one graph lowers (exact: keep, recompute, reformulate)
EXACT = ("none", "recompute", "invact", "invact-act", "chunked-ce")
# the codec strategies the one graph lowers, each to its traced codec (``compiled.codec.CODECS``)
LOWERS = {"int8": "int8", "int4": "int4"}
# what compile=True takes into the one graph by itself: the parts whose one graph peaks no
# higher than their per-block form. Recompute and the codecs lower too (``recompute+graph``,
# ``int8+graph`` written as such), but the single backward graph holds more at once than the
# per-block path's (a block's recomputation or decodes at a time), so their step peak is higher
# there: measured in BENCHMARKS.md (compile=True as one graph). Not int4 in any case by
# itself: in the one graph the root's saves are coded too, and INT4 groups on the residual
# stream fail the massive-activation bounds (``tests/test_codec_values.py``).
DEFAULT = ("none", "invact", "invact-act", "chunked-ce")
CODECS: tuple[str, ...] = ()


def graph_form(strategy: str, model: nn.Module | None = None) -> str | None:
    """The spec ``compile=True`` applies as one graph (``"invact+chunked-ce"`` ->
    ``"invact+chunked-ce+graph"``, ``"none"`` -> ``"graph"``), or None where the spec keeps the
    per-block compiled path. The one place that decides it, by this rule: the model runs as one
    graph (:func:`one_graph_ok`), and every part is in :data:`DEFAULT` or is one of
    :data:`CODECS` written without settings, at most one such codec. Anything else keeps the
    per-block path: ``recompute`` and the codecs (their one graph peaks higher, see
    :data:`DEFAULT`; ``<spec>+graph`` written as such lowers them), ``offload``, ``auto@<b>``
    (its per-block form, ``compiled-auto``, plans compiled blocks with measured compiled costs;
    ``auto@<b>+graph`` lowers the eager plan as one graph), a ``compiled-*`` spec written as
    such, a Hugging Face model."""
    if model is not None and not one_graph_ok(model):
        return None
    try:
        parts = [p for p in spec.parse(strategy) if p.name != "none"]
    except ValueError:
        return None
    codecs = [p for p in parts if p.name in CODECS]
    if len(codecs) > 1 or any(p.settings for p in codecs):
        return None
    if any(p.name not in DEFAULT and p.name not in CODECS for p in parts):
        return None
    return spec.join([*parts, NAME])


def one_graph_ok(model: nn.Module) -> bool:
    """Does ``model`` run as one graph? slimact's own models do; a Hugging Face model does not
    yet (its forward graph-breaks inside the selective-checkpoint regions, and an eagerly run
    region's recomputation does not replay its ops in order): it keeps the per-block path."""
    return not is_hf_model(hf_model_of(model))


# ops a recomputation pays for: kept ones are saved whatever the partitioner would rebuild
_HEAVY = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
}


def _heavy(op: Any) -> bool:
    name = getattr(op, "name", lambda: "")()
    return op in _HEAVY or "scaled_dot_product" in name or name.startswith("slimact::")


def _module_path(region: str) -> str | None:
    """The path, relative to ``region``, of the module the op being traced belongs to (its
    node's ``nn_module_stack``), or None where the trace carries no module (eager)."""
    stack = (fx_traceback.get_current_meta() or {}).get("nn_module_stack") or {}
    if not stack:
        return None
    last = str(next(reversed(stack.values()))[0])
    tokens = re.sub(r"\[['\"]?([^\]'\"]*)['\"]?\]", r".\1", last).split(".")
    want = region.split(".") if region else []
    for i in range(len(tokens) - len(want), -1, -1):
        if tokens[i : i + len(want)] == want:
            return ".".join(tokens[i + len(want) :])
    return None


def _inside(path: str, module: str) -> bool:
    return module == "" or path == module or path.startswith(module + ".")


@dataclasses.dataclass(frozen=True)
class SitePolicy:
    """The selective-checkpoint policy of one region: ``recompute`` are the modules (relative to
    ``region``) the plan recomputes; every other op is kept (module docstring)."""

    region: str
    recompute: tuple[str, ...]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        path = _module_path(self.region)
        if path is None:  # eager (dynamo fell back): recompute only what is surely planned so
            return CheckpointPolicy.PREFER_RECOMPUTE if "" in self.recompute else _keep(op)
        if any(_inside(path, m) for m in self.recompute):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return _keep(op)


def _keep(op: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if _heavy(op) else CheckpointPolicy.PREFER_SAVE


def _region_forward(inner: Callable[..., Any], policy: SitePolicy, *args: Any, **kwargs: Any):
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=context, **kwargs)


def _call(inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return inner(*args, **kwargs)


_codes = itertools.count()


Codec = str | SiteCodecs | None  # one traced codec for every save, one per module, or none


def _graph_forward(
    inner: Callable[..., Any], compiled: NotCopyable, codec: Codec, *args: Any, **kwargs: Any
):
    limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    hooks = contextlib.ExitStack()
    if codec:  # the traced pair around the call; its inlining finds saved RNG states by name
        pair = site_hooks(codec) if isinstance(codec, SiteCodecs) else codec_hooks(codec)
        hooks.enter_context(pair)
        hooks.enter_context(matched_rng_names())
    with dynamo_config.patch(recompile_limit=limit), hooks:
        return compiled(inner, *args, **kwargs)


def regions(model: nn.Module, plan: Plan) -> dict[str, tuple[str, ...]]:
    """Region -> the modules it recomputes (relative): each block the plan recomputes in, and
    each root module it recomputes outside the blocks."""
    blocks = sites.block_paths(model)
    out: dict[str, list[str]] = {}
    for lp in plan.layers:
        for rel in lp.recompute:
            full = abs_path(rel, lp.block)
            region = next((b for b in blocks if _inside(full, b) and b), full)
            sub = full[len(region) + 1 :] if full != region else ""
            out.setdefault(region, []).append(sub)
    return {r: tuple(sorted(set(m))) for r, m in out.items()}


def site_table(plan: Plan) -> tuple[dict[str, str], list[str]]:
    """The per-module traced codecs of ``plan``'s site codecs (``compiled.site_codecs``: each
    module takes the widest of its sites' codecs), and the labels no traced codec lowers
    (their sites are kept as they are in the graph)."""
    table: dict[str, list[str]] = {}
    unlowered: list[str] = []
    for lp in plan.layers:
        for label, rel_sites in lp.codecs:
            traced = traced_label(label)
            if traced is None:
                unlowered.append(label)
                continue
            for rel in rel_sites:
                table.setdefault(site_module(abs_site(rel, lp.block)), []).append(traced)
    return {m: widest(c) for m, c in table.items()}, sorted(set(unlowered))


def lower(
    model: nn.Module, plan: Plan, codec: str | None = None, **compile_kwargs: Any
) -> list[AppliedChange]:
    """Lower ``plan`` onto ``model`` and compile its root forward as one graph (module
    docstring), every tensor the graph saves through the traced ``codec``
    (``compiled.codec.CODECS``; None: stored as it is), or, where the plan gives sites codecs,
    each through its module's (:func:`site_table`). Returns the changes; the first one's undo
    takes everything back off. A plan with lazy rules is refused (the fixed-rule codecs lower
    by name: ``codec``)."""
    if plan.rules or (codec and any(lp.codecs for lp in plan.layers)):
        raise ValueError(
            "the one compiled graph lowers keep, recompute, reformulations and traced codecs "
            "(one for every save, or one per module from the plan's site codecs); a plan with "
            "lazy codec rules compiles per block"
        )
    undos: list[Callable[[], None]] = []
    rows: list[AppliedChange] = []
    try:
        reforms = dataclasses.replace(
            plan,
            layers=tuple(dataclasses.replace(lp, recompute=(), codecs=()) for lp in plan.layers),
        )
        patched, undo = patch_plan(model, reforms)
        undos.append(undo)
        rows += [AppliedChange(c.path, c.action, c.detail) for c in patched]
        modules = dict(model.named_modules())
        for region, recompute in regions(model, plan).items():
            if region not in modules:
                raise ValueError(f"plan recomputes {region!r}, which is not a module of the model")
            _, undo = override_forward(
                modules[region], _region_forward, SitePolicy(region, recompute)
            )
            undos.append(undo)
            what = ", ".join(m or "(all)" for m in recompute)
            rows.append(AppliedChange(region, "recompute", f"selective checkpoint: {what}"))
        hooks: Codec = codec
        if any(lp.codecs for lp in plan.layers):
            table, unlowered = site_table(plan)
            hooks = SiteCodecs.of(model, table)
            what = ", ".join(f"{m or '(root)'}: {c}" for m, c in sorted(table.items()))
            rows.append(AppliedChange("", "codec", f"traced per module: {what}"))
            if unlowered:
                rows.append(AppliedChange("", "keep", f"not lowered: {', '.join(unlowered)}"))
        compile_kwargs.setdefault("dynamic", None)
        compile_kwargs.setdefault("backend", os.environ.get(BACKEND_VARIABLE) or "inductor")
        fn = own_code(_call, f"graph_{type(model).__name__}_{next(_codes)}")
        compiled = NotCopyable(torch.compile(fn, **compile_kwargs), "a compiled graph")
        _, undo = override_forward(model, _graph_forward, compiled, hooks)
        undos.append(undo)
        if codec:
            rows.append(AppliedChange("", "codec", f"traced {codec} pack/unpack on every save"))
        sites.seal(model)  # the router hooks nothing inside; the model checks its ids in-graph
        undos.append(functools.partial(sites.seal, model, False))
    except BaseException:
        run_all(*reversed(undos))
        raise
    head = AppliedChange(
        "",
        "compile-graph",
        "root forward and loss as one graph (one forward, one backward per step)",
        undo=functools.partial(run_all, *reversed(undos)),
    )
    return [head, *rows]


class Pending:
    """A plan solved on the first training batch (``auto@<b>``), then lowered as one graph:
    ``planner(input_ids, targets) -> Plan``; ``rows``: the lowering's changes, once done."""

    def __init__(self, model: nn.Module, planner: Callable[..., Plan], **compile_kwargs: Any):
        self.model, self.planner, self.compile_kwargs = model, planner, compile_kwargs
        self.rows: list[AppliedChange] = []
        self.undos: list[Callable[[], None]] = []

    def undo(self) -> None:
        run_all(*reversed(self.undos))
        self.undos.clear()


def _planning_forward(inner: Callable[..., Any], pending: Pending, *args: Any, **kwargs: Any):
    model = pending.model
    if not (torch.is_grad_enabled() and model.training):
        return inner(*args, **kwargs)  # eval, no_grad: eager until the first training batch
    ids = args[0] if args else kwargs.get("input_ids")
    pending.undo()  # the planner profiles the model as it is
    plan = pending.planner(ids, kwargs.get("targets"))
    pending.rows = lower(model, plan, **pending.compile_kwargs)
    pending.undos.append(pending.rows[0].undo)
    st = peek(model)
    if st is not None:  # the lowering's rows join the model's change log (the head undoes them)
        st.applied.extend(pending.rows[1:])
    return model(*args, **kwargs)


def lower_on_first_batch(
    model: nn.Module, planner: Callable[..., Plan], **compile_kwargs: Any
) -> list[AppliedChange]:
    """:func:`lower` the plan ``planner`` solves on the first training batch (its
    ``(input_ids, targets)``), when that batch comes: until then the model runs eager. Returns
    the head change, whose undo takes back whichever is installed."""
    pending = Pending(model, planner, **compile_kwargs)
    _, undo = override_forward(model, _planning_forward, pending)
    pending.undos.append(undo)
    what = "root forward and loss as one graph, planned on the first training batch"
    return [AppliedChange("", "compile-graph", what, undo=pending.undo)]


def is_graph(model: nn.Module) -> bool:
    """Does ``model``'s forward run as one compiled graph (:func:`lower`)?"""
    f = model.__dict__.get("forward")
    return getattr(f, "wrapper", None) in (_graph_forward, _planning_forward)
