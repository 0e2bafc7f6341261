"""Small measuring helpers of the profiler: median wall times, calls on captured inputs.

``median_time`` synchronizes CUDA around each run; ``time_delta`` compares two of them round by
round; ``call_module`` / ``fwd_bwd`` re-run a module
on inputs captured during the profiling forward (detached copies sharing their storages, so a
re-run's saves can be matched to the profiled storages by pointer).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], Any], repeats: int, device: torch.device, warmup: bool = True
) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after one warm-up (``warmup``)."""
    if warmup:
        fn()
    times = []
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_delta(
    new: Callable[[], Any], old: Callable[[], Any], repeats: int, device: torch.device
) -> float:
    """Median seconds of ``new()`` minus median seconds of ``old()``, one call of each per round
    (after one warm-up call each), so drifting machine load cancels."""
    t_new, t_old = [], []
    for _ in range(max(1, repeats)):
        t_new.append(median_time(new, 1, device))
        t_old.append(median_time(old, 1, device))
    return statistics.median(t_new) - statistics.median(t_old)


def detach(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().requires_grad_(v.requires_grad and v.is_floating_point())
    return v


def call_module(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    with torch.enable_grad():
        return module(*[detach(a) for a in args], **{k: detach(v) for k, v in kwargs.items()})


def fwd_bwd(
    module: nn.Module, args: tuple, kwargs: dict, forward: Callable[..., Any] | None = None
) -> None:
    """One forward and backward of ``module`` on ``args`` (``forward``: another forward of it,
    e.g. its class's where the instance's is patched, run instead of the module call)."""
    with torch.enable_grad():
        a = [detach(x) for x in args]
        out = (forward or module)(*a, **{k: detach(v) for k, v in kwargs.items()})
        leaves = [x for x in a if isinstance(x, torch.Tensor) and x.requires_grad]
        leaves += [p for p in module.parameters() if p.requires_grad]
        if isinstance(out, torch.Tensor) and out.requires_grad and leaves:
            torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
