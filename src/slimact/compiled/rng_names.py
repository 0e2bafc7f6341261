"""Traced codec hooks beside recomputed seeded ops: the saved RNG states matched by name.

A selective-checkpoint region that recomputes an op tagged ``nondeterministic_seeded`` (SDPA's
ops carry the tag even without dropout) has its RNG state saved for backward: on a device
without graph-safe RNG (the CPU), the partitioner's ``functionalize_rng_ops`` makes each state a
forward output (a ``getitem`` of ``run_and_save_rng_state``) and a backward input named
``rng_state_output_<k>``. AOTAutograd's inlining of traced saved-tensor hooks
(``maybe_inline_graph_saved_tensors_hooks``, ``compiled/codec.py``) finds each saved tensor's
backward input *by name*, so those states fail it (``could not find saved tensor getitem_<n> in
bw_g_inputs``): the names differ, the positions match.

:func:`matched_rng_names` wraps the partitioner's pass while a compiled call runs under it:
after the pass, the k-th saved state of the forward graph takes the k-th backward input's name.
Nothing else changes (the graphs' order and code are the pass's); without the pass (another
torch) it does nothing.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx

try:
    from torch._functorch import partitioners as _partitioners
    from torch._prims.rng_prims import run_and_save_rng_state as _save_rng
except ImportError:  # pragma: no cover - another torch
    _partitioners = _save_rng = None

STATE_PREFIX = "rng_state_output_"  # the backward inputs the pass names


def _states(fw: torch.fx.GraphModule) -> list[torch.fx.Node]:
    outs = fw.graph.output_node().args[0]
    return [
        n
        for n in outs
        if isinstance(n, torch.fx.Node)
        and n.target is operator.getitem
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].target is _save_rng
        and n.args[1] == 0
    ]


def rename_states(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """Give each saved RNG state of ``fw`` the name of its input in ``bw`` (module docstring);
    returns how many were renamed."""
    inputs = [n for n in bw.graph.find_nodes(op="placeholder") if n.name.startswith(STATE_PREFIX)]
    states = _states(fw)
    if len(states) != len(inputs):
        return 0  # not the pass's shape: leave the graphs as they are
    renamed = 0
    for state, inp in zip(states, inputs):
        if state.name != inp.name:
            state._rename(inp.name)
            renamed += state.name == inp.name
    if renamed:
        fw.recompile()
    return renamed


def _wrapped(inner: Any) -> Any:
    @functools.wraps(inner)
    def functionalize_rng_ops(*args: Any, **kwargs: Any) -> Any:
        fw, bw = inner(*args, **kwargs)
        rename_states(fw, bw)
        return fw, bw

    functionalize_rng_ops.slimact_inner = inner
    return functionalize_rng_ops


@contextmanager
def matched_rng_names() -> Iterator[None]:
    """While it is entered, the partitioner's RNG pass names the saved states as their backward
    inputs (module docstring)."""
    inner = getattr(_partitioners, "functionalize_rng_ops", None)
    if inner is None or _save_rng is None or hasattr(inner, "slimact_inner"):
        yield
        return
    _partitioners.functionalize_rng_ops = _wrapped(inner)
    try:
        yield
    finally:
        _partitioners.functionalize_rng_ops = inner
