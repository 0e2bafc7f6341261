"""RMSNorms that save (x, rstd) instead of op-by-op (x, x̂): ``ops/rms_norm``.

PRAC's ``fuse_norms`` (``strategies/prac.py``): one tensor per norm is then worth compressing,
as prac.txt's Table 3 counts. Plans say it as ``reformulate`` with kind ``rms-norm`` (action
``reformulate:rms_norm``); the plan runtime applies it with :func:`apply_fused_rms`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from slimact.actions import FUSED_RMS
from slimact.classify import classify_norm, rms_eps
from slimact.ops.rms_norm import rms_norm
from slimact.patching import override_forward
from slimact.registry import AppliedChange, FilterFn


def _fused_rms_forward(inner, module: nn.Module, eps: float | None, x: torch.Tensor):
    return rms_norm(x, module.weight, eps=eps)


def fusable_rms_norms(model: nn.Module, filter_fn: FilterFn | None = None) -> list[str]:
    """The RMSNorms of ``model`` that ``filter_fn`` passes and nothing has patched yet (an
    inverted norm of ``invact``, applied first, stays inverted)."""
    paths = []
    for path, m in model.named_modules():
        if "forward" in m.__dict__ or (filter_fn is not None and not filter_fn(m, path)):
            continue
        w = getattr(m, "weight", None)
        kind, _ = classify_norm(m, w.device if isinstance(w, torch.Tensor) else torch.device("cpu"))
        if kind == "rms":
            paths.append(path)
    return paths


def apply_fused_rms(
    model: nn.Module, paths: list[str] | set[str], action: str = FUSED_RMS
) -> list[AppliedChange]:
    """Swap the RMSNorms at ``paths`` for the fused op; one undoable change each."""
    modules = dict(model.named_modules())
    changes = []
    for path in sorted(paths, key=list(modules).index):
        m = modules[path]
        _, undo = override_forward(m, _fused_rms_forward, m, rms_eps(m))
        changes.append(
            AppliedChange(path, action, "RMSNorm saves (x, rstd), not (x, x̂)", undo=undo)
        )
    return changes


__all__ = ["FUSED_RMS", "apply_fused_rms", "fusable_rms_norms"]
