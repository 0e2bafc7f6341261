"""Peak memory over a whole training step, measured: CUDA allocator stats, CPU profiler events.

Saved bytes (``slimact.measure``) count what autograd keeps between forward and backward; a step's
*peak* also counts the temporaries around it: a codec's scratch buffers, a recomputed block's
activations during backward, the gradients. ``step_peak(fn, device)`` runs ``fn`` once and
returns the peak of live bytes *above* what was live when it started (weights, optimizer state
and the batch are excluded on both devices, so CPU and GPU figures read the same):

- CUDA: ``max_memory_allocated() - memory_allocated()`` after ``reset_peak_memory_stats()``.
- CPU: the torch profiler's memory events (``profile_memory=True``): every allocation and free
  with its size, in time order; the peak is the largest running sum. The profiler slows the step
  down, so never time a step that is measured this way. Kineto (torch 2.13) prints a
  ``USDT: ... profiler_start`` / ``profiler_stop`` line to the process's stderr at each start and
  stop; those two moments run with file descriptor 2 pointed at /dev/null (``quiet_stderr``) so
  the lines do not land in the middle of a user's progress bar. Those moments hold one lock of
  the process, so two threads' saves and restores of file descriptor 2 never interleave (which
  would leave it at /dev/null for good).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

T = TypeVar("T")
_FD_LOCK = threading.RLock()  # file descriptor 2 is the process's: one save/restore at a time


def step_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Run ``fn()`` once; return its peak of live bytes above the bytes live at its start."""
    return peak_and_result(fn, device)[0]


def peak_and_result(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[int, T]:
    """``step_peak`` that also returns what ``fn()`` returned."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - start), out
    if device.type != "cpu":
        raise ValueError(f"step_peak supports cpu and cuda devices, got {device}")
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.__enter__()
    try:
        out = fn()
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
    return peak_from_profile(prof), out


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Point file descriptor 2 at /dev/null for the block (C++ logging bypasses ``sys.stderr``),
    holding the process's lock on it (threads take turns)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real fd (e.g. captured): nothing to hide
        yield
        return
    with _FD_LOCK:
        sys.stderr.flush()
        saved = os.dup(fd)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), fd)
                try:
                    yield
                finally:
                    os.dup2(saved, fd)
        finally:
            os.close(saved)


def peak_from_profile(prof: profile) -> int:
    """Largest running sum of a CPU profile's allocation (+) and free (-) events, in time order."""
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda t: t[0])
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
