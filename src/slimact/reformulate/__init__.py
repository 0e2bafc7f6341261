"""The reformulate action: replace an op by one that computes the same and saves less.

Three families, one action word (``reformulate:<op>`` in plans and reports):

* ``activations`` (invact.txt): GELU / tanh-GELU / SiLU save their output plus 1 bit, RMSNorm /
  LayerNorm their output plus rstd, instead of their input (``apply_invact``);
* ``norms``: an RMSNorm saving (x, rstd) instead of (x, x̂) (PRAC's ``fuse_norms``,
  ``apply_fused_rms``);
* ``head``: the loss head's output projection and cross-entropy computed in token chunks,
  keeping (h, targets, lse) instead of the logits (``apply_chunked_ce``).

Each is used by its strategies (``invact``, ``invact-act``, ``chunked-ce``, ``prac``) and by the plan
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
from slimact.reformulate.norms import FUSED_RMS, apply_fused_rms, fusable_rms_norms

__all__ = [
    "FUSED_RMS",
    "ChunkedCEConfig",
    "InvActConfig",
    "apply_chunked_ce",
    "apply_fused_rms",
    "apply_invact",
    "fallback_report",
    "find_head",
    "fusable_rms_norms",
    "loss_output",
    "park_labels",
    "probe_consumers",
]
