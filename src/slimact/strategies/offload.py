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
with a ``ValueError`` saying so (the plan runtime, installing a plan that offloads). The strategy is a plan (``offload_part``, also
``slimact.plan_of(model, "offload")``): ``recompute``'s blocks, each one's
``:checkpoint_input#0`` through the codec ``offload``, on the plan runtime (``strategies/parts.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from slimact.actions import OFFLOAD_CODEC
from slimact.registry import FilterFn, StrategyConfig, register_strategy
from slimact.strategies.parts import Part
from slimact.strategies.recompute import RecomputeConfig, recompute_part


@dataclass(frozen=True)
class OffloadStrategyConfig(StrategyConfig):
    """Checkpoint every block (``filter_fn`` selects) and offload the inputs it keeps."""

    preserve_rng_state: bool = True


BLOCK_INPUT = ":checkpoint_input#0"  # a recomputed block's input, block-relative


def offload_part(
    model: nn.Module, config: OffloadStrategyConfig, filter_fn: FilterFn | None
) -> Part:
    """``recompute``'s blocks, each one's input (its checkpoint's first save) through the
    offload codec; and ``recompute``'s rows."""
    plan, rows = recompute_part(model, RecomputeConfig(config.preserve_rng_state), filter_fn)
    if not plan.layers:
        return plan, rows
    offloaded = ((OFFLOAD_CODEC, (BLOCK_INPUT,)),)
    layers = tuple(dataclasses.replace(lp, codecs=offloaded) for lp in plan.layers)
    return dataclasses.replace(plan, layers=layers, meta=(("strategy", "offload"),)), rows


register_strategy(
    "offload",
    OffloadStrategyConfig(),
    preset=offload_part,
    description="recompute every block, its input offloaded to pinned host memory (CUDA only)",
    codec_policy=True,
    compiled_form="compiled-offload",  # block inputs in host memory, an eager wrapper per block
)
