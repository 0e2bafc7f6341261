"""The pieces of one training step shared by the trainer and its baseline twin.

``make_optimizer`` (AdamW, decay on matrices only), ``autocast_for`` (bf16 on CUDA, none on CPU),
``forward_backward`` (micro-batches, ``loss / grad_accum``, timed), ``clip_and_step`` and
``evaluate`` (mean validation loss).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn as nn

Batch = tuple[torch.Tensor, torch.Tensor]


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def autocast_for(device: str) -> Callable[[], AbstractContextManager[Any]]:
    if device.startswith("cuda"):
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], device: str) -> float:
    """Mean next-token loss over ``batches`` (weighted by rows); restores the train/eval mode."""
    was_training = model.training
    model.eval()
    total, rows = 0.0, 0
    try:
        for x, y in batches:
            with autocast_for(device)():
                loss = model(x.to(device), targets=y.to(device)).loss
            total += float(loss.float().item()) * x.shape[0]
            rows += x.shape[0]
    finally:
        model.train(was_training)
    return total / rows


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW, betas (0.9, 0.95); weight decay on >= 2-D parameters only (tied ones once)."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


def forward_backward(
    model: nn.Module,
    batches: Sequence[Batch],
    device: str,
    first: Callable[[Callable[[], torch.Tensor]], torch.Tensor] | None = None,
) -> tuple[float, float]:
    """Forward and backward of every micro-batch (``loss / len(batches)``): (mean loss, seconds).

    ``first(run)``, if given, runs the first micro-batch's forward (``run()`` returns its loss),
    e.g. inside the meter. Gradients accumulate into ``.grad``; nothing is zeroed here.
    """
    loss_sum, seconds = 0.0, 0.0
    for i, (x, y) in enumerate(batches):
        sync(device)
        t0 = time.perf_counter()
        with autocast_for(device)():

            def run(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return model(x, targets=y).loss

            loss = first(run) if (first is not None and i == 0) else run()
        (loss / len(batches)).backward()
        sync(device)
        seconds += time.perf_counter() - t0
        loss_sum += float(loss.detach().float().item())
    return loss_sum / len(batches), seconds


def clip_and_step(optimizer: torch.optim.Optimizer, clip: float) -> float:
    """Clip the gradient norm (``clip`` 0: measure only), step; returns the norm before clipping."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    optimizer.step()
    return float(norm.item())
