"""Inverted RMSNorm / LayerNorm: exact forward, gradients vs autograd, fallback, memory."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimact
from slimact.models.common import RMSNorm
from slimact.modules import InvLayerNorm, InvRMSNorm
from slimact.ops.inv_norm import (
    inv_layer_norm,
    inv_rms_norm,
    invertible,
    rms_norm_ref,
    weight_floor,
)

# max |grad error| / max |grad| against exact autograd
TOL = {
    torch.float32: 2e-5,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
    torch.float64: 1e-6,
}  # fp64: x.float() rounds to fp32
DTYPES = list(TOL)


def _grads(fn, x, params, dy):
    x = x.detach().requires_grad_(True)
    ps = [p.detach().requires_grad_(True) if p is not None else None for p in params]
    y = fn(x, *ps)
    leaves = [x] + [p for p in ps if p is not None]
    return y, torch.autograd.grad(y, leaves, dy)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 33), (5, 64), (1, 1, 3)])
def test_rms_norm_exact_forward_and_grads(dtype, shape):
    d = shape[-1]
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    w = (1 + 0.3 * torch.randn(d, dtype=torch.float64)).to(dtype)
    dy = torch.randn(shape, dtype=torch.float64).to(dtype)
    y0, g0 = _grads(lambda x, w: rms_norm_ref(x, w, 1e-6), x, [w], dy)
    y1, g1 = _grads(lambda x, w: inv_rms_norm(x, w, 1e-6), x, [w], dy)
    assert torch.equal(y0, y1)
    for a, b in zip(g1, g0):
        assert a.dtype == b.dtype and _rel(a, b) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("shape,norm", [((3, 9, 40), (40,)), ((4, 6, 5), (6, 5)), ((17,), (17,))])
def test_layer_norm_exact_forward_and_grads(dtype, affine, shape, norm):
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.5).to(dtype)
    w = (1 + 0.3 * torch.randn(norm, dtype=torch.float64)).to(dtype) if affine != "none" else None
    b = (0.2 * torch.randn(norm, dtype=torch.float64)).to(dtype) if affine == "wb" else None
    dy = torch.randn(shape, dtype=torch.float64).to(dtype)
    y0, g0 = _grads(lambda x, w, b: F.layer_norm(x, norm, w, b, 1e-5), x, [w, b], dy)
    y1, g1 = _grads(lambda x, w, b: inv_layer_norm(x, norm, w, b, 1e-5), x, [w, b], dy)
    assert torch.equal(y0, y1)
    for a, c in zip(g1, g0):
        assert a.shape == c.shape and _rel(a, c) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_or_tiny_weight_falls_back_to_saving_x(dtype):
    d = 16
    w = torch.ones(d, dtype=dtype)
    w[3] = 0.0
    assert "min |weight|" in invertible(w, None, dtype)
    w2 = torch.ones(d, dtype=dtype)
    w2[5] = weight_floor(dtype) / 4
    assert invertible(w2, None, dtype) is not None
    assert invertible(torch.ones(d, dtype=dtype), None, dtype) is None
    x = torch.randn(3, d, dtype=dtype)
    dy = torch.randn(3, d, dtype=dtype)
    # gradients stay exact (the zero weight's dw needs x̂, which y = 0 would have lost)
    _, g0 = _grads(lambda x, w: rms_norm_ref(x, w, 1e-6), x, [w], dy)
    _, g1 = _grads(lambda x, w: inv_rms_norm(x, w, 1e-6), x, [w], dy)
    for a, b in zip(g1, g0):
        assert torch.equal(a, b)
    m = InvRMSNorm(d).to(dtype)
    with torch.no_grad():
        m.weight[3] = 0.0
    xr = x.clone().requires_grad_(True)
    with slimact.measure(m) as meter:
        m(xr).sum().backward()
    ops = {s.op for s in meter.report.sites}
    assert ops == {"inv_rms_norm_fallback"} and m.fallbacks == 1
    with torch.no_grad():  # weight recovers -> the cached check re-runs (version changed)
        m.weight[3] = 1.0
    with slimact.measure(m) as meter:
        m(xr).sum().backward()
    assert {s.op for s in meter.report.sites} == {"inv_rms_norm"}


def test_layer_norm_large_bias_ratio_falls_back():
    w, b = torch.full((8,), 0.01), torch.full((8,), 1.0)
    assert "bias" in invertible(w, b, torch.float32, max_bias_ratio=4.0)
    m = InvLayerNorm(8)
    with torch.no_grad():
        m.weight.fill_(0.01)
        m.bias.fill_(1.0)
    x = torch.randn(2, 8, requires_grad=True)
    y = m(x)
    assert torch.equal(y, F.layer_norm(x, (8,), m.weight, m.bias, m.eps))
    assert m.fallbacks == 1 and "bias" in m.inv.reason


def test_inv_rmsnorm_module_matches_slimact_rmsnorm_and_state_dict():
    a, b = RMSNorm(24), InvRMSNorm(24)
    with torch.no_grad():
        a.weight.normal_()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 5, 24)
    assert torch.equal(a(x), b(x))


def test_memory_norm_then_linear():
    """RMSNorm -> Linear: baseline saves x, x̂ and y; inverted saves y (shared) + rstd."""
    d, n = 32, 40
    lin = nn.Linear(d, 8, bias=False)
    x = torch.randn(n, d, requires_grad=True)

    def measure(norm):
        model = nn.Sequential(norm, lin)
        with slimact.measure(model) as m:
            model(x).sum().backward()
        return m.report.total_bytes

    base, inv = measure(RMSNorm(d)), measure(InvRMSNorm(d))
    assert base == 3 * n * d * 4 + n * 4  # x, x̂, y, rstd
    assert inv == n * d * 4 + n * 4  # y, rstd
    base_ln, inv_ln = measure(nn.LayerNorm(d)), measure(InvLayerNorm(d))
    assert base_ln - inv_ln == n * d * 4 + n * 4  # x and mean no longer kept (rstd is)


def test_bad_input():
    with pytest.raises(TypeError, match="floating-point"):
        inv_rms_norm(torch.ones(2, 3, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="normalized_shape"):
        inv_layer_norm(torch.randn(2, 3), (4,))
