"""Small helpers: seeding, byte formatting, device choice, work in a worker thread."""

from __future__ import annotations

import importlib
import random
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model`` lives: its first parameter's device (else its first buffer's, else CPU)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def default_device() -> str:
    """'cuda' when a GPU is visible, else 'cpu' (queried at call time, never at import)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, feature: str) -> Any:
    """Import optional ``module`` for ``feature``, or raise one line naming ``slimact[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(
            f"{feature} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'slimact[{extra}]'"
        ) from exc


PLANNER_THREAD = "slimact-planner"  # the name of in_worker_thread's thread


def in_worker_thread(fn: Callable[[], Any], device_type: str = "cpu") -> Any:
    """``fn()`` in a worker thread, its result returned and its error re-raised here.

    Grad mode, saved-tensor hooks, torch-function modes and slimact's site router are
    thread-local, so work done there (profiling passes of a planner that runs inside a training
    forward) is neither routed nor counted by what the calling thread has entered; autocast is
    carried over."""
    amp = torch.is_autocast_enabled(device_type)
    amp_dtype = torch.get_autocast_dtype(device_type) if amp else None
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            with torch.autocast(device_type, dtype=amp_dtype) if amp else ExitStack():
                out["result"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    worker = threading.Thread(target=work, name=PLANNER_THREAD)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def refuse_compiled_call(model: torch.nn.Module) -> None:
    """For a root hook that runs eagerly around what slimact compiles (the blocks of
    ``compile=True``): under dynamo it is traced only where the user compiled the model whole
    after ``slimact.apply`` (``torch.compile(model)``, ``model.compile()``), a graph that would
    run past slimact's hooks, silently without its actions. Then the call raises instead."""
    if torch.compiler.is_compiling():
        _raise_compiled_call(type(model).__name__)


@torch.compiler.disable  # runs eagerly at the graph break: its error reaches the caller
def _raise_compiled_call(name: str) -> None:
    raise RuntimeError(
        f"{name} was compiled whole (torch.compile(model) or model.compile()) after "
        "slimact.apply: the compiled graph runs past slimact's hooks, so training would "
        "silently run without slimact's actions. Compile through slimact instead, on the "
        "uncompiled model: slimact.revert(model) (or use the model you passed to "
        "torch.compile), then slimact.apply(model, spec, compile=True), which compiles every "
        "block with the strategy's actions inside"
    )
