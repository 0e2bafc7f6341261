"""``chunked-ce``: the loss head (output projection + cross-entropy) without stored logits.

The head's loss is computed in token chunks (``slimact.ops.chunked_ce``), keeping (h, targets,
lse) instead of the N x V log-probabilities; spec ``chunked-ce@256,precompute`` sets the chunk
size and mode. How the head is found, verified and patched is ``slimact.reformulate.head``'s;
the planner considers the same action for the head (``auto``).
"""

from __future__ import annotations

from slimact.reformulate.head import ChunkedCEConfig, apply_chunked_ce
from slimact.registry import register_strategy

register_strategy(
    "chunked-ce",
    ChunkedCEConfig(),
    apply_chunked_ce,
    "loss head: linear + cross-entropy in token chunks, no stored logits (recomputed in backward)",
    compile_safe=True,
)
