"""``cola`` and ``cola-m``: CoLA (cola.txt) as strategies.

``cola-m`` (CoLA-M, §4.2) works on a CoLA model (``cola-*`` from the registry, or
``slimact.cola.convert(...)``): each block keeps only its input, the mid-block residual and the
seven rank-r pre-activations A·x (2d + 7r values per token, Eq. 19) and recomputes the rest; see
``slimact.cola.colam``. Blocks that are not CoLA blocks are reported as skipped with the reason;
a model with no CoLA block at all is an error (nothing would change, which would be misleading).
The strategy is a plan (``colam_part``: the blocks ``find_colam`` finds), each CoLA block
reformulated whole, kind ``cola-m``: the plan runtime's block reformulation, registered here
(``register_block_reform``), applied by the runtime (``strategies/parts.py``).

``cola`` is the architecture itself. CoLA replaces every projection W by B σ(A x), which cannot
carry W's weights over, so it is not an in-place transform of a trained model. Semantics chosen:
``apply(model, "cola")`` is a *marker* that is accepted only on a model that already is CoLA
(it records one ``cola`` change per ``CoLALinear`` and modifies nothing), so that
``slimact memory --model cola-20m --strategy cola`` / ``slimact train --model cola-20m --strategy
cola`` state what they run. On a full-rank model it raises and says how to get a CoLA model. As a plan (``plan_of(model,
"cola")``) it is the empty plan with those rows, so ``cola+int4`` is ``int4``'s plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from slimact import sites
from slimact.cola.colam import colam_block, unsupported_reason
from slimact.cola.layers import CoLALinear
from slimact.planner.apply import register_block_reform
from slimact.planner.plan import Plan
from slimact.planner.settings import RecomputeSettings
from slimact.registry import AppliedChange, FilterFn, StrategyConfig, register_strategy
from slimact.strategies.parts import Part, reform_part


@dataclass(frozen=True)
class CoLAConfigMarker(StrategyConfig):
    """``cola``: assert the model is CoLA (architecture, not a transform)."""


@dataclass(frozen=True)
class CoLAMConfig(StrategyConfig):
    """``cola-m``: CoLA-M checkpointing of every CoLA block that passes ``filter_fn``."""

    preserve_rng_state: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.preserve_rng_state, bool):
            raise ValueError(f"preserve_rng_state must be a bool, got {self.preserve_rng_state!r}")


_NOT_COLA = (
    "{what} needs a CoLA model: CoLA changes the architecture (every projection becomes "
    "B·σ(A·x)) and cannot keep full-rank weights. Build one with "
    "slimact.build_model('cola-20m') (see `slimact models`) or slimact.cola.convert(model)"
)


def cola_part(model: nn.Module, config: CoLAConfigMarker, filter_fn: FilterFn | None) -> Part:
    """``cola`` changes nothing: the empty plan, on a model the strategy accepts (CoLA), and its
    rows (one per ``CoLALinear``)."""
    layers = [(p, m) for p, m in model.named_modules() if isinstance(m, CoLALinear)]
    if not layers:
        raise ValueError(_NOT_COLA.format(what="strategy 'cola'"))
    rows = [
        AppliedChange(p, "cola", f"{m.in_features}->{m.rank}->{m.out_features} ({m.activation})")
        for p, m in layers
    ]
    return Plan(meta=(("strategy", "cola"),)), rows


def find_colam(model: nn.Module, filter_fn: FilterFn | None = None) -> list[AppliedChange]:
    """The blocks ``cola-m`` would switch to CoLA-M, found without changing the model: one row
    per block (skipped with the reason: filtered out, forward already patched, not a CoLA
    block); no undo. A model that is not CoLA, or whose blocks it can handle none of, raises."""
    if not any(isinstance(m, CoLALinear) for m in model.modules()):
        raise ValueError(_NOT_COLA.format(what="strategy 'cola-m'"))
    modules = dict(model.named_modules())
    changes: list[AppliedChange] = []
    for path in sites.block_paths(model):
        block = modules[path]
        if filter_fn is not None and not filter_fn(block, path):
            changes.append(AppliedChange(path, COLAM, "filtered out", skipped=True))
        elif "forward" in block.__dict__:
            changes.append(AppliedChange(path, COLAM, "forward already patched", skipped=True))
        elif why := unsupported_reason(block):
            changes.append(AppliedChange(path, COLAM, why, skipped=True))
        else:
            changes.append(
                AppliedChange(path, COLAM, "save x, h and the 7 rank-r A·x; recompute B")
            )
    if not any(not c.skipped for c in changes):
        reasons = "; ".join(f"{c.path}: {c.detail}" for c in changes) or "no repeated blocks"
        raise ValueError(f"strategy 'cola-m' found no block it can handle ({reasons})")
    return changes


def colam_part(model: nn.Module, config: CoLAMConfig, filter_fn: FilterFn | None) -> Part:
    """The CoLA blocks ``find_colam`` finds, each reformulated whole (kind ``cola-m``: the
    runtime's block reformulation, registered below), its recomputations keeping the RNG state
    as ``config`` says (the ``recompute`` settings); and the strategy's rows."""
    rows = find_colam(model, filter_fn)
    return reform_part(model, COLAM, rows, RecomputeSettings(config.preserve_rng_state))


COLAM = "cola-m"  # the plan runtime's block reformulation of the same name (``plan_of``)
register_block_reform(COLAM, colam_block)

register_strategy(
    "cola",
    CoLAConfigMarker(),
    preset=cola_part,
    description="CoLA architecture marker: only valid on cola-* models (cola.txt §3)",
    compile_safe=True,
)
register_strategy(
    "cola-m",
    CoLAMConfig(),
    preset=colam_part,
    description="CoLA-M: keep x, h and rank-r A·x per block, recompute up-projections + attention",
)
