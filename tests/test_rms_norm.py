"""ops/rms_norm: the RMSNorm that saves (x, rstd) matches exact autograd and saves one (…, d)."""

from __future__ import annotations

import pytest
import torch

import slimact
from slimact.ops.inv_norm import rms_norm_ref
from slimact.ops.rms_norm import rms_norm


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
