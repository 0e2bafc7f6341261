"""The reformulate action: replace an op by one that computes the same and saves less.

Two families, one action word (``reformulate:<op>`` in plans and reports):

* ``activations`` (invact.txt): GELU / tanh-GELU / SiLU save their output plus 1 bit, RMSNorm /
  LayerNorm their output plus rstd, instead of their input (``apply_invact``);
* ``head``: the loss head's output projection and cross-entropy computed in token chunks,
  keeping (h, targets, lse) instead of the logits (``apply_chunked_ce``).

Both are used by their strategies (``invact``, ``invact-act``, ``chunked-ce``) and by the plan
runtime (``slimact.planner.apply``) for a plan's reformulated modules.
"""

from slimact.reformulate.activations import (
    InvActConfig,
    apply_invact,
    fallback_report,
    probe_consumers,
)
from slimact.reformulate.head import (
    ChunkedCEConfig,
    apply_chunked_ce,
    find_head,
    loss_output,
    park_labels,
)

__all__ = [
    "ChunkedCEConfig",
    "InvActConfig",
    "apply_chunked_ce",
    "apply_invact",
    "fallback_report",
    "find_head",
    "loss_output",
    "park_labels",
    "probe_consumers",
]
