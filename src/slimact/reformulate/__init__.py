"""The reformulate action: replace an op by one that computes the same and saves less.

Three families, one action word (``reformulate:<op>`` in plans and reports):

* ``activations`` (invact.txt): GELU / tanh-GELU / SiLU save their output plus 1 bit, RMSNorm /
  LayerNorm their output plus rstd, instead of their input (``find_invact`` finds, ``patch_invact`` swaps);
* ``norms``: an RMSNorm saving (x, rstd) instead of (x, x̂) (PRAC's ``fuse_norms``,
  ``apply_fused_rms``);
* ``head``: the loss head's output projection and cross-entropy computed in token chunks,
  keeping (h, targets, lse) instead of the logits (``find_chunked_ce`` finds,
  ``patch_chunked_ce`` patches).

Each strategy (``invact``, ``invact-act``, ``chunked-ce``, ``prac``) finds its modules with the
finder and states them in its plan; the plan runtime (``slimact.planner.apply``) patches a plan's
reformulated modules with the patchers, the one place the model is changed.
"""

from slimact.reformulate.activations import (
    InvActConfig,
    fallback_report,
    find_invact,
    patch_invact,
    probe_consumers,
)
from slimact.reformulate.head import (
    ChunkedCEConfig,
    find_chunked_ce,
    find_head,
    loss_output,
    park_labels,
    patch_chunked_ce,
)
from slimact.reformulate.norms import FUSED_RMS, apply_fused_rms, fusable_rms_norms

__all__ = [
    "FUSED_RMS",
    "ChunkedCEConfig",
    "InvActConfig",
    "apply_fused_rms",
    "fallback_report",
    "find_chunked_ce",
    "find_head",
    "find_invact",
    "fusable_rms_norms",
    "loss_output",
    "park_labels",
    "patch_chunked_ce",
    "patch_invact",
    "probe_consumers",
]
