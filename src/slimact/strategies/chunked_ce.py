"""``chunked-ce``: the loss head (output projection + cross-entropy) without stored logits.

The head's loss is computed in token chunks (``slimact.ops.chunked_ce``), keeping (h, targets,
lse) instead of the N x V log-probabilities; spec ``chunked-ce@256,precompute`` sets the chunk
size and mode. How the head is found and verified is ``slimact.reformulate.head``'s
(``find_chunked_ce``); the strategy states it as a plan (``chunked_ce_part``: the head as
``reform`` of the root's row, its settings as ``Plan.settings``) that the plan runtime applies
(``strategies/parts.py``). The planner considers the same action for the head (``auto``).
"""

from __future__ import annotations

import torch.nn as nn

from slimact.planner.settings import ChunkedCESettings
from slimact.reformulate.head import ChunkedCEConfig, find_chunked_ce
from slimact.registry import FilterFn, register_strategy
from slimact.strategies.parts import Part, reform_part


def chunked_ce_part(model: nn.Module, config: ChunkedCEConfig, filter_fn: FilterFn | None) -> Part:
    """The loss head ``find_chunked_ce`` finds (its loss check included) as ``reform`` of the
    root's row, and how it computes (``ChunkedCESettings``); and the strategy's row."""
    rows = find_chunked_ce(model, config, filter_fn)
    return reform_part(model, "chunked-ce", rows, ChunkedCESettings.of(config))


register_strategy(
    "chunked-ce",
    ChunkedCEConfig(),
    preset=chunked_ce_part,
    description="loss head: linear + cross-entropy in token chunks, no stored logits (recomputed in backward)",
    compile_safe=True,
)
