"""``recompute``: non-reentrant activation checkpointing of every block.

Each repeated block (a child of a ``ModuleList``/``Sequential``) runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: autograd stores nothing inside it and
the block is re-run in backward. What stays stored per block is the block input, which the
checkpoint saves through autograd (so the meter sees it), named ``<block>:checkpoint_input#0``
(``slimact.checkpointing.checkpointed``: the one checkpoint wrapper, shared with the plan runtime).
The strategy is a plan (``recompute_part``: the blocks ``find_recompute`` finds), installed on
the plan runtime (``strategies/parts.py``). The forward is patched on the instance (a
``patching.ForwardOverride``, so copies and pickles of the model checkpoint their own blocks),
so module paths and the state_dict are unchanged.

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
from slimact.checkpointing import checkpointed
from slimact.patching import overrides
from slimact.planner.plan import Plan
from slimact.planner.settings import RecomputeSettings
from slimact.registry import AppliedChange, FilterFn, StrategyConfig
from slimact.strategies.parts import Part, layers_of


@dataclass(frozen=True)
class RecomputeConfig(StrategyConfig):
    """Checkpoint every block whose path passes ``filter_fn`` (all blocks by default)."""

    preserve_rng_state: bool = True


def find_recompute(model: nn.Module, filter_fn: FilterFn | None = None) -> list[AppliedChange]:
    """The blocks ``recompute`` would checkpoint, found without changing the model: one row per
    block (skipped with the reason: filtered out, already checkpointed, forward already
    patched), or one skipped row for a model without repeated blocks; no undo."""
    changes = []
    modules = dict(model.named_modules())
    for path in sites.block_paths(model):
        block = modules[path]
        if filter_fn is not None and not filter_fn(block, path):
            changes.append(AppliedChange(path, "recompute", "filtered out", skipped=True))
        elif any(o.wrapper is checkpointed for o in overrides(block)):
            changes.append(AppliedChange(path, "recompute", "already checkpointed", skipped=True))
        elif "forward" in block.__dict__ and not sites.sealed(block):  # compiled: the plan's
            why = "forward already patched (e.g. by cola-m)"
            changes.append(AppliedChange(path, "recompute", why, skipped=True))
        else:
            changes.append(AppliedChange(path, "recompute"))
    if not changes:
        changes.append(AppliedChange("", "recompute", "model has no repeated blocks", skipped=True))
    return changes


def recompute_part(model: nn.Module, config: RecomputeConfig, filter_fn: FilterFn | None) -> Part:
    """``recompute`` as a plan: the blocks ``find_recompute`` finds, each recomputed whole,
    keeping the RNG state as ``config`` says (the ``recompute`` settings); and its rows."""
    rows = find_recompute(model, filter_fn)
    paths = [c.path for c in rows if not c.skipped]
    if not paths:
        return Plan(), rows
    plan = Plan(
        layers=layers_of(model, "recompute", paths),
        meta=(("strategy", "recompute"),),
        settings={"recompute": RecomputeSettings(config.preserve_rng_state)},
    )
    return plan, rows
