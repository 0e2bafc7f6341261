"""A forward whose backward never runs (a meter's, a probe's, a loss computed only to log it)
must leave nothing of its graph alive once its outputs are dropped. A saved-tensor hook whose
packed result holds the saved tensor itself closes a reference cycle through autograd's C++
graph that Python's collector cannot break: every such forward kept its whole graph (on a GPU,
a compiled-auto profile of llama-1b held 99 GiB this way)."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import slimact
from slimact.codecs.offload import using_streams
from slimact.models import build_model


@contextmanager
def _frozen():
    """Everything alive now moved to gc's permanent generation (``gc.freeze``) until the block
    ends: ``gc.get_objects()`` lists only what was made since, and ``gc.collect()`` scans only
    that, where a full scan of the whole process (a worker of the whole suite) took seconds a
    test. A new object is listed whoever holds it, so a leak is found as with a set of the ids
    seen before (without that set's id reuse)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _graph_tensors() -> int:
    """Tensors created since the freeze that still carry a grad_fn (part of a live graph)."""
    gc.collect()
    n = 0
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor) or isinstance(o, FakeTensor):
            continue
        if o.grad_fn is not None:
            n += 1
    return n


def _forward_only(model, x) -> None:
    model(x, targets=x).loss.item()  # a loss read for a log line, never backpropagated


SPECS = ["none", "int4", "int8", "invact", "recompute", "chunked-ce", "prac", "int4+invact",
         "auto@50%", "offload", "compile:int8"]  # fmt: skip


@pytest.mark.parametrize("spec", SPECS)
def test_forward_without_backward_frees_its_graph(spec, fake_streams):
    torch.manual_seed(0)
    model = build_model("llama-tiny", dtype=torch.float32)
    x = torch.randint(0, model.config.vocab_size, (2, 32))
    with using_streams(fake_streams):
        if spec.startswith("compile:"):
            slimact.apply(model, spec.removeprefix("compile:"), compile=True)
        elif spec != "none":
            slimact.apply(model, spec)
        model(x, targets=x).loss.backward()  # a first step (plans, probes, lazy state)
        model.zero_grad(set_to_none=True)
        with _frozen():
            _forward_only(model, x)
            assert _graph_tensors() == 0
            with slimact.measure(model) as meter:  # the meter's forward too, once released
                _forward_only(model, x)
            assert meter.report.total_bytes > 0
            del meter
            assert _graph_tensors() == 0


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # exp and tanh save their outputs
        return x + self.b(F.silu(self.a(x)).exp().tanh())


def test_double_backward_through_the_router_is_exact():
    # what is kept as is is kept detached, and autograd gives the unpacked tensor its grad_fn
    # back: a gradient penalty (grad of grad) under the meter is exact, not silently cut
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block()).double()
    x = torch.randn(4, 16, dtype=torch.float64)

    def penalty_grads(metered: bool) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        params = list(model.parameters())
        if metered:
            with slimact.measure(model):
                loss = model(x).pow(2).sum()
        else:
            loss = model(x).pow(2).sum()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        sum((g**2).sum() for g in grads).backward()
        return [p.grad.clone() for p in params]

    for a, b in zip(penalty_grads(False), penalty_grads(True)):
        assert torch.equal(a, b) and a.abs().max() > 0
