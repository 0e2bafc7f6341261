"""``recompute``: non-reentrant activation checkpointing of every block.

Each repeated block (a child of a ``ModuleList``/``Sequential``) runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: autograd stores nothing inside it and
the block is re-run in backward. What stays stored per block is the block input, which the
checkpoint saves through autograd (so the meter sees it), named ``<block>:checkpoint_input#0``
(``slimact.checkpointing.checkpointed``: the one checkpoint wrapper, shared with the plan runtime).
The forward is patched on the instance (a ``patching.ForwardOverride``, so copies and pickles of
the model checkpoint their own blocks), so module paths and the state_dict are unchanged.

KV caches (Hugging Face decoders): a block that writes a cache would write it a second time when
backward re-runs it (the returned cache doubles; at one token the replay's keys differ in shape
and backward raises ``CheckpointError``). As with HF's own gradient checkpointing, a training
forward (model in training mode, grad enabled) of a model whose forward takes ``use_cache`` runs
with ``use_cache=False``, with one warning per model when that overrides a cache the caller or
the config asked for. A block that still receives a cache with grad on (a cache passed in
explicitly, or an eval-mode forward under grad) runs without checkpointing, so its cache is
written once and its gradients stay exact. Without grad (eval, ``generate``) nothing changes.
The helpers live in ``slimact.checkpointing``, shared with the plan runtime (``auto``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from slimact import sites
from slimact.checkpointing import checkpoint_module, checkpointed, guard_cache
from slimact.patching import overrides
from slimact.registry import AppliedChange, FilterFn, StrategyConfig


@dataclass(frozen=True)
class RecomputeConfig(StrategyConfig):
    """Checkpoint every block whose path passes ``filter_fn`` (all blocks by default)."""

    preserve_rng_state: bool = True


def apply_recompute(
    model: nn.Module, config: RecomputeConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    changes = []
    modules = dict(model.named_modules())
    for path in sites.block_paths(model):
        block = modules[path]
        if filter_fn is not None and not filter_fn(block, path):
            changes.append(AppliedChange(path, "recompute", "filtered out", skipped=True))
            continue
        if any(o.wrapper is checkpointed for o in overrides(block)):
            changes.append(AppliedChange(path, "recompute", "already checkpointed", skipped=True))
            continue
        if "forward" in block.__dict__:
            why = "forward already patched (e.g. by cola-m)"
            changes.append(AppliedChange(path, "recompute", why, skipped=True))
            continue
        undo = checkpoint_module(block, config.preserve_rng_state)
        changes.append(AppliedChange(path, "recompute", undo=undo))
    if not changes:
        changes.append(AppliedChange("", "recompute", "model has no repeated blocks", skipped=True))
    elif any(not c.skipped for c in changes):
        guard = guard_cache(model)
        if guard is not None:
            changes.append(guard)
    return changes
