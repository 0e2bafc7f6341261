"""Under torch.autocast, parameter casts (a linear's low-precision weight copy) are no sites.

Autocast makes each linear save its weight cast to bf16/fp16 besides its input. Those copies must
not shift site names, reach a codec, or count as activations; the meter reports them apart.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import slimact
from slimact import sites
from slimact.codecs.saving import CodecPolicy
from slimact.compare import grad_cosine
from slimact.models import build_model

STRATEGIES = ("int4", "int8", "prac", "invact", "recompute")
B, S = 2, 64


def _ids():
    return torch.randint(0, 257, (B, S), generator=torch.Generator().manual_seed(1))


def _amp(dtype):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def _weight_cast(t: torch.Tensor) -> bool:
    """Independent of the router: ``t`` views a ToCopy of a parameter's AccumulateGrad."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    acc = fn.next_functions[0][0]
    return isinstance(getattr(acc, "variable", None), nn.Parameter)


def _sites(model, dtype, backward=False):
    x = _ids()
    with slimact.measure(model) as m, _amp(dtype):
        loss = model(x, targets=x).loss
    if backward:
        loss.backward()
    return m.report


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_site_names_and_actions_equal_with_and_without_autocast(strategy, one_thread):
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), strategy)
    fp32 = _sites(model, None)
    bf16 = _sites(model, torch.bfloat16, backward=True)  # prac crashed here before
    assert [s.site for s in bf16.sites] == [s.site for s in fp32.sites]
    if strategy != "prac":  # prac's only_if_smaller weighs payload + fp32 basis vs bf16 bytes
        assert [s.action for s in bf16.sites] == [s.action for s in fp32.sites]
    assert fp32.param_cast_bytes == 0 and fp32.param_casts == 0
    if strategy != "recompute":  # checkpointed blocks save nothing under the router
        assert bf16.param_casts > 0
    if strategy in ("int4", "int8", "prac"):
        assert any(s.action != "keep" for s in bf16.sites)


def test_fp16_autocast_names_too(one_thread):
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), "int4")
    fp32, fp16 = _sites(model, None), _sites(model, torch.float16)
    assert [(s.site, s.action) for s in fp16.sites] == [(s.site, s.action) for s in fp32.sites]


def test_meter_counts_param_casts_apart(one_thread):
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    fp32, bf16 = _sites(model, None), _sites(model, torch.bfloat16)
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    assert bf16.param_cast_bytes == sum(w.numel() * 2 for w in weights)
    assert bf16.param_casts == len(weights)
    assert [s.site for s in bf16.sites] == [s.site for s in fp32.sites]
    assert bf16.total_bytes == sum(s.bytes for s in bf16.sites)
    assert bf16.total_bytes < fp32.total_bytes
    assert "parameter casts" in bf16.table() and "parameter casts" not in fp32.table()
    assert bf16.to_dict()["param_cast_bytes"] == bf16.param_cast_bytes


def test_frozen_parameter_casts_are_recognised(one_thread):
    """A frozen weight's cast has no grad_fn: matched by value against the op's parameter."""
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight.requires_grad_(False)
    fp32, bf16 = _sites(model, None), _sites(model, torch.bfloat16)
    assert [s.site for s in bf16.sites] == [s.site for s in fp32.sites]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert bf16.param_casts == len(linears)


def test_is_param_cast_rejects_activations():
    lin = nn.Linear(8, 8)
    x = torch.randn(8, 8, requires_grad=True)  # a leaf that is no parameter
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xc = x.to(torch.bfloat16)
        wc = lin.weight.to(torch.bfloat16)
    assert not sites.is_param_cast(xc) and not sites.is_param_cast(x)
    assert sites.is_param_cast(wc) and sites.is_param_cast(wc.t())


@pytest.mark.parametrize("strategy", ("int4", "int8", "prac@only_if_smaller=false"))
def test_no_codec_receives_a_parameter_cast(strategy, monkeypatch, one_thread):
    seen: list[torch.Tensor] = []
    inner = CodecPolicy.__call__

    def spy(self, site, t):
        seen.append(t)
        return inner(self, site, t)

    monkeypatch.setattr(CodecPolicy, "__call__", spy)
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), strategy)
    x = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, targets=x).loss
    loss.backward()
    assert seen and not any(_weight_cast(t) for t in seen)


@pytest.mark.parametrize(
    "strategy, bound", [("int4", 0.97), ("int8", 0.99), ("invact", 0.99), ("recompute", 0.9999)]
)
def test_gradients_under_autocast_match_exact(strategy, bound, one_thread):
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), strategy)
    x = _ids()
    for m in (base, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, targets=x).loss
        loss.backward()
    assert grad_cosine(base, model) >= bound


def test_prac_gradient_under_autocast(one_thread):
    torch.manual_seed(0)
    base = build_model("llama-tiny")
    torch.manual_seed(0)
    model = slimact.apply(build_model("llama-tiny"), "prac@only_if_smaller=false")
    x = _ids()
    for m in (base, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, targets=x).loss
        loss.backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    gb = torch.cat([p.grad.flatten() for p in base.parameters()])
    assert float(nn.functional.cosine_similarity(g, gb, dim=0)) > 0.75
    assert slimact.strategies.prac.prac_report(model)["compressed"]
