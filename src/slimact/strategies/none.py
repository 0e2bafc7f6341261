"""``none``: the baseline; every site keeps its tensor (registered in ``slimact.strategies``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from slimact.planner.plan import Plan
from slimact.registry import AppliedChange, FilterFn, StrategyConfig


@dataclass(frozen=True)
class NoneConfig(StrategyConfig):
    """The baseline: every site keeps its tensor."""


def none_part(
    model: nn.Module, config: NoneConfig, filter_fn: FilterFn | None
) -> tuple[Plan, list[AppliedChange]]:
    """The strategy as a plan: the empty plan, no rows."""
    return Plan(meta=(("strategy", "none"),)), []
