"""``invact`` / ``invact-act``: the inverted-activation strategies (invact.txt).

``invact-act`` is the paper as published: every GELU / tanh-GELU / SiLU saves ``y`` + 1 bit
instead of ``x``. ``invact`` also inverts RMSNorm / LayerNorm (``y`` + rstd instead of ``x``).
Both are the ``reformulate`` action applied to every candidate the probe accepts: how candidates
are found and verified is ``slimact.reformulate``'s (``find_invact``); the strategy states them
as a plan (``invact_part``: ``reform`` rows, its other settings as ``Plan.settings``) that the
plan runtime applies (``strategies/parts.py``; the swap is ``reformulate.patch_invact``).
"""

from __future__ import annotations

import torch.nn as nn

from slimact.planner.settings import InvActSettings
from slimact.reformulate import InvActConfig, find_invact
from slimact.registry import FilterFn, register_strategy
from slimact.strategies.parts import Part, reform_part


def invact_part(model: nn.Module, config: InvActConfig, filter_fn: FilterFn | None) -> Part:
    """The modules ``find_invact`` would invert (its probe included), as ``reform`` per block,
    and how they compute (``InvActSettings``); and the strategy's rows."""
    name = "invact" if config.norms else "invact-act"
    rows = find_invact(model, config, filter_fn)
    return reform_part(model, name, rows, InvActSettings.of(config))


register_strategy(
    "invact",
    InvActConfig(),
    preset=invact_part,
    description="inverted GELU/SiLU (y + 1 bit) and RMSNorm/LayerNorm (y + rstd) saving outputs (invact.txt)",
    compile_safe=True,
    # norms only under compile: inductor already keeps an activation's input and recomputes its
    # output, so an inverted GELU/SiLU adds its bit mask and an opaque op (BENCHMARKS.md)
    compile_args="ops=none",
)
register_strategy(
    "invact-act",
    InvActConfig(norms=False),
    preset=invact_part,
    description="invact.txt as published: inverted GELU/SiLU only (y + 1 bit instead of x)",
    compile_safe=True,
)
