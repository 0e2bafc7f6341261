"""ops/rms_norm: the RMSNorm that saves (x, rstd) matches exact autograd and saves one (…, d)."""

from __future__ import annotations

import pytest
import torch

import slimact
from slimact.ops.inv_norm import rms_norm_ref
from slimact.ops.rms_norm import rms_norm, rsqrt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 7, 33), (1, 5), (2, 1, 1, 128)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_output_and_gradients_match_the_reference(dtype, shape, with_weight):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype) if with_weight else None
    dy = torch.randn(*shape, generator=g).to(dtype)
    outs = []
    for fn in (rms_norm_ref, rms_norm):
        xi = x.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True) if w is not None else None
        y = fn(xi, wi, 1e-6)
        y.backward(dy)
        outs.append((y, xi.grad, None if wi is None else wi.grad))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for got, want in zip(outs[1], outs[0]):
        if want is None:
            assert got is None
        else:
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, **tol)


class Norm(torch.nn.Module):
    def __init__(self, fn, d: int) -> None:
        super().__init__()
        self.fn, self.weight = fn, torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.fn(x, self.weight, 1e-6)


def test_saves_the_input_and_rstd_only():
    x = torch.randn(4, 16, 64, requires_grad=True)
    ref, fused = Norm(rms_norm_ref, 64), Norm(rms_norm, 64)
    with slimact.measure(ref) as m_ref:
        ref(x * 1).sum().backward()
    with slimact.measure(fused) as m_fused:
        fused(x * 1).sum().backward()
    d_bytes, rows = 4 * 16 * 64 * 4, 4 * 16 * 4
    assert m_fused.report.total_bytes == d_bytes + rows  # x and rstd; the weight is a parameter
    assert m_ref.report.total_bytes == 2 * d_bytes + rows  # x, rstd and x̂


def test_no_grad_runs_the_reference_and_integer_input_is_rejected():
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, None), rms_norm_ref(x, None, 1e-6))
    with pytest.raises(ValueError, match="floating-point input, got torch.int64"):
        rms_norm(torch.ones(2, 3, dtype=torch.long), None)


# --- rsqrt: the statistic of slimact's op-by-op RMSNorm -------------------------------------------


def test_rsqrt_matches_autograd_and_passes_gradcheck():
    u = (torch.rand(5, 1, dtype=torch.float64) + 0.1).requires_grad_()
    assert torch.autograd.gradcheck(rsqrt, (u,))
    x = torch.randn(3, 7, 16, requires_grad=True)
    u32 = x.pow(2).mean(-1, keepdim=True) + 1e-6
    (g1,) = torch.autograd.grad(rsqrt(u32).sum(), x)
    (g2,) = torch.autograd.grad(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6).sum(), x)
    torch.testing.assert_close(g1, g2)


def test_rsqrt_backward_does_not_underflow_where_autograds_does():
    """u = mean(x²) = 1e34, dL/dr = 1e18 (a 1e17 residual stream): dL/du = -5e-34 is a normal
    float32, but autograd's -½·g·r³ forms r³ = 1e-51 first and returns 0."""
    u64 = torch.tensor([[1e34], [3e35], [2e31]], dtype=torch.float64)
    g64 = torch.tensor([[1e18], [-4e18], [2e16]], dtype=torch.float64)
    truth = -0.5 * g64 * u64.pow(-1.5)

    def grad(fn):
        u = u64.float().requires_grad_()
        (du,) = torch.autograd.grad((fn(u) * g64.float()).sum(), u)
        return du.double()

    torch.testing.assert_close(grad(rsqrt), truth, rtol=1e-5, atol=0)
    assert bool((grad(torch.rsqrt) == 0).all())  # what slimact's RMSNorm used to get


def test_rsqrt_saves_under_the_rsqrt_site():
    m = slimact.build_model("llama-tiny")
    ids = torch.randint(0, 256, (1, 8))
    with slimact.measure(m) as meter:
        m(ids, targets=ids).loss.backward()
    assert any(s.site == "layers.0.input_layernorm:rsqrt#0" for s in meter.report.sites)
