"""What a training step runs outside compiled graphs, counted from ``torch.profiler`` events.

A ``TorchDispatchMode`` cannot count it: under one, dynamo runs the graphs' code eagerly, so
every op would look eager. The profiler's events keep the nesting instead. A compiled forward
runs inside a ``Torch-Compiled Region`` range (its AOTAutograd function is ``CompiledFunction``)
and its backward inside ``CompiledFunctionBackward``. An ``aten::`` op is *outside* when no
compiled range and no other ``aten::`` op encloses it (a top-level op: a composite's inner
ops are not counted again). Gradient accumulation into ``.grad`` (``AccumulateGrad``, the same
under whole-model ``torch.compile``) is not counted; the optimizer is not profiled at all.

:func:`outside_figures` reads a profile's events (``slimact bench --profile`` counts its steps
with it); :func:`count_step` runs and profiles one training step of a model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "slimact.step"  # the range one counted step runs in
FORWARD_REGION = "Torch-Compiled Region"  # dynamo's range around a compiled frame's call
FORWARD_GRAPH = "CompiledFunction"  # AOTAutograd's forward graph (training)
BACKWARD_GRAPH = "CompiledFunctionBackward"  # its backward graph
_INSIDE = (FORWARD_REGION, FORWARD_GRAPH, BACKWARD_GRAPH, "torch::autograd::AccumulateGrad")


@dataclass
class StepCount:
    """Per step: top-level aten ops outside compiled graphs (``eager_ops``; the most frequent
    in ``top``), compiled forward and backward graph calls, and dynamo's region calls."""

    eager_ops: float
    forward_graphs: float
    backward_graphs: float
    regions: float
    top: list[tuple[str, float]] = field(default_factory=list)

    @property
    def graphs(self) -> float:
        """Compiled graph calls per step, forward and backward."""
        return self.forward_graphs + self.backward_graphs


def _enclosed(event: Any) -> bool:
    """Is ``event`` inside a compiled range or another aten op (or gradient accumulation)?"""
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("aten::") or parent.name.startswith(_INSIDE):
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


def outside_figures(events: Iterable[Any], step: str = STEP, top: int = 8) -> StepCount:
    """Per-step figures of the ``step`` ranges among a profile's ``events`` (the host events
    that start inside one; per step: divided by the number of ranges)."""
    events = [e for e in events if e.device_type == DeviceType.CPU]
    steps = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == step)
    if not steps:
        raise ValueError(f"no {step!r} range among the profile's events")

    def in_step(e: Any) -> bool:
        return any(a <= e.time_range.start <= b for a, b in steps)

    mine = [e for e in events if e.name != step and in_step(e)]
    eager = Counter(e.name for e in mine if e.name.startswith("aten::") and not _enclosed(e))
    names = Counter(e.name for e in mine)
    n = len(steps)
    regions = sum(v for k, v in names.items() if k.startswith(FORWARD_REGION))
    return StepCount(
        eager_ops=sum(eager.values()) / n,
        forward_graphs=names[FORWARD_GRAPH] / n,
        backward_graphs=names[BACKWARD_GRAPH] / n,
        regions=regions / n,
        top=[(k, v / n) for k, v in eager.most_common(top)],
    )


def count_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    warmup: int = 2,
    steps: int = 1,
    label: str = "targets",
) -> StepCount:
    """Run ``warmup`` training steps (forward with ``targets`` as the keyword ``label``:
    ``labels`` for Hugging Face models; backward: the compiles happen here), then ``steps`` more
    under the profiler, and count what ran outside compiled graphs (module docstring).
    Gradients are set to None before the counted steps and after them."""

    def step() -> None:
        out = model(input_ids, **{label: targets})
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()

    for _ in range(warmup):
        step()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP):
                step()
    model.zero_grad(set_to_none=True)
    return outside_figures(prof.events())
