"""``none``: the baseline; every site keeps its tensor (registered in ``slimact.strategies``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from slimact.registry import AppliedChange, StrategyConfig


@dataclass(frozen=True)
class NoneConfig(StrategyConfig):
    """The baseline: every site keeps its tensor."""


def apply_none(model: nn.Module, config: NoneConfig, filter_fn=None) -> list[AppliedChange]:
    return []
