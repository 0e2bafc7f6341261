"""The inverted activations' CPU path: their plain-PyTorch ``*_ref`` functions, compiled.

Eager, the Newton backward of ``slimact.ops.inv_act`` is ~150 small elementwise ops per call,
each a full pass over memory (plus boolean-mask gathers): on llama-20m it made the whole training
step ~1.5× slower than strategy ``none`` on one CPU thread. ``call(fn, *tensors, **static)``
runs ``fn`` compiled by inductor instead: one fused, vectorized loop per call.

* compiled once per (function, static arguments) — kind, mode, variant —, lazily at first use,
  never at import; ``dynamic=True`` (callers pass flat tensors, so one symbolic size serves every
  shape) and ``fullgraph=True`` (the refs are written without graph breaks: ``dense=True``
  selects the pointwise Newton form).
* each key gets its own copy of the function's code object, since dynamo keeps its cache (and
  its recompile limit of 8) per code object: a process using every kind × mode × variant never
  falls back to eager behind our back.
* if compiling fails (no C++ compiler, an unsupported platform...), one warning, and from then
  on every call runs the eager reference.

The refs themselves stay the reference: tests compare this path against them.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable

import torch

MIN_NUMEL = 1 << 14  # below this the eager ref is as fast as a compiled call's dispatch

_COMPILED: dict[tuple, Callable] = {}
_BROKEN: list[str] = []  # why compiling was given up (at most one entry)


def available() -> bool:
    """False once a compile has failed (every later call runs eagerly)."""
    return not _BROKEN


def _own_code(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object (dynamo caches per code object)."""
    code = fn.__code__.replace()
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def compiled(fn: Callable, **static) -> Callable:
    """``fn`` with ``static`` bound, compiled by inductor (cached per (fn, static))."""
    key = (fn, tuple(sorted(static.items())))
    c = _COMPILED.get(key)
    if c is None:
        part = functools.partial(_own_code(fn), **static)
        c = _COMPILED[key] = torch.compile(part, dynamic=True, fullgraph=True)
    return c


def call(fn: Callable, *tensors: torch.Tensor, **static):
    """``fn(*tensors, **static)``, compiled; the eager ``fn`` if compiling is unavailable."""
    if _BROKEN:
        return fn(*tensors, **static)
    c = compiled(fn, **static)
    try:
        return c(*tensors)
    except Exception as e:  # the compiler is optional: any failure of it means eager
        _BROKEN.append(f"{type(e).__name__}: {e}")
        warnings.warn(
            f"slimact: torch.compile of {fn.__name__} failed ({_BROKEN[0][:300]}); inverted "
            "activations run their eager PyTorch reference on CPU from now on (correct, slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return fn(*tensors, **static)
