"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.

The schedule is a pure function of the step index, so its checkpointed "state" is just its four
parameters and the step; a resumed run recomputes exactly the same learning rates. Step ``i``
(0-based) of the warm-up uses ``lr * (i + 1) / warmup_steps``; after it the rate follows half a
cosine from ``lr`` (first post-warm-up step) towards ``min_lr`` (reached after the last step).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class WarmupCosine:
    lr: float
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"warmup_steps must be in [0, {self.total_steps}], got {self.warmup_steps}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @property
    def min_lr(self) -> float:
        return self.lr * self.min_lr_ratio

    def __call__(self, step: int) -> float:
        """Learning rate of (0-based) optimizer step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Write step ``step``'s rate into every param group; returns it."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, float | int]) -> WarmupCosine:
        return cls(
            lr=float(state["lr"]),
            total_steps=int(state["total_steps"]),
            warmup_steps=int(state["warmup_steps"]),
            min_lr_ratio=float(state["min_lr_ratio"]),
        )
