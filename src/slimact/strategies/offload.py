"""``offload``: every block recomputed, and the block inputs it keeps moved to host memory.

What ``recompute`` keeps per block, the block input its checkpoint saves
(``<block>:checkpoint_input#k``), is stored through the offload codec (``codecs/offload.py``):
copied to pinned host memory on a side stream as the forward goes on, and copied back one block
ahead in backward, while the block after it recomputes and runs its backward. The device then
holds no saved activations between the blocks' forward and backward but the root's (embedding,
final norm, head): Unsloth's offloaded gradient checkpointing, built from slimact's two actions
``recompute`` and ``offload``. Exact: outputs and gradients are bit-identical to ``recompute``'s.

The trade-off: each block input crosses the host link twice; the copies hide behind a block's
compute when ``bytes / bandwidth`` is below it (large blocks, short links), else the step waits
for them. The planner (``auto`` with a ``host_budget``) weighs that per storage instead.

CUDA only: on a CPU model the saved tensors are in host memory already, so ``apply`` refuses
with a ``ValueError`` saying so. The policy is a codec policy (one per model: ``offload`` does not
compose with ``int4``, ``prac`` or a plan). ``slimact.plan_of(model, "offload")`` is the same as a
plan: ``recompute``'s blocks, each one's ``:checkpoint_input#0`` through the codec ``offload``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from slimact.codecs.base import Codec, get_codec
from slimact.codecs.offload import check_model
from slimact.codecs.saving import CodecPolicy
from slimact.planner.apply import install_policy
from slimact.registry import AppliedChange, FilterFn, StrategyConfig, register_strategy
from slimact.strategies.recompute import RecomputeConfig, apply_recompute


@dataclass(frozen=True)
class OffloadStrategyConfig(StrategyConfig):
    """Checkpoint every block (``filter_fn`` selects) and offload the inputs it keeps."""

    preserve_rng_state: bool = True


def _assign(blocks: frozenset[str], codec: Codec, site: str, t: torch.Tensor) -> Codec | None:
    module, _, op = site.rpartition(":")
    return codec if module in blocks and op.startswith("checkpoint_input#") else None


def apply_offload(
    model: nn.Module, config: OffloadStrategyConfig, filter_fn: FilterFn | None = None
) -> list[AppliedChange]:
    check_model(model)
    changes = apply_recompute(model, RecomputeConfig(config.preserve_rng_state), filter_fn)
    blocks = frozenset(c.path for c in changes if c.action == "recompute" and not c.skipped)
    if not blocks:
        return changes
    policy = CodecPolicy(functools.partial(_assign, blocks, get_codec("offload")))
    change = install_policy(model, policy)
    change.detail = f"inputs of {len(blocks)} checkpointed block(s) -> offload (pinned host)"
    return [*changes, change]


register_strategy(
    "offload",
    OffloadStrategyConfig(),
    apply_offload,
    "recompute every block, its input offloaded to pinned host memory (CUDA only)",
    codec_policy=True,
    compiled_form="compiled-offload",  # block inputs in host memory, an eager wrapper per block
)
