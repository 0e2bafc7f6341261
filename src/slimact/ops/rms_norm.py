"""RMSNorm that saves its input and the per-row rstd only (the "reformulate" action for norms).

RMSNorm written op by op (``rms_norm_ref``: ``w · (x · rsqrt(mean(x²) + eps))``) saves two
(…, d) tensors for backward: x (for ``pow`` and ``x · rstd``) and x̂ = x · rstd (for ``w · x̂``).
A fused backward needs only x and rstd (…, 1), because x̂ = x · rstd is one multiply away:

    dL/dx̂ = g = dy · w,        dL/dx = rstd · (g − x̂ · mean(g · x̂)),        dL/dw = Σ dy · x̂.

So this function halves the norm's saved bytes (d + 1 instead of 2d + 1 floats per token) at the
cost of one elementwise multiply in backward, with the same forward and the same gradients as the
reference up to fp32 re-association. ``prac`` uses it so a norm stores one compressed tensor (its
input, as prac.txt's Table 3 assumes), and the backward then differentiates at the reconstructed
input X̃ with the exact rstd. The plain-PyTorch reference is ``ops.inv_norm.rms_norm_ref``.

``rsqrt`` is the statistic's op for the op-by-op RMSNorm of slimact's models: ``torch.rsqrt`` with
a backward that does not underflow. Autograd differentiates ``r = u^-½`` as ``-½·g·r³``; with a
residual stream of 1e17 (one extreme weight is enough) ``r³`` is 1e-54, below float32's range, so
the norm's whole projection term vanishes and the gradient is wrong (cosine −0.1 against the
float64 truth; ``tests/test_extreme_values.py``). Computing ``-½·((g·r)·r)·r`` keeps every partial product in range
(``g·r`` is O(|dy|·√d)). It saves the same tensor (r) under the same site name (``rsqrt#0``).
Under ``torch.compile`` it is plain ``torch.rsqrt`` (dynamo would trace the Function as a
higher-order op and break the graph on the site router's bookkeeping), so compiled blocks keep
autograd's formula.
"""

from __future__ import annotations

import torch

from slimact import sites
from slimact.ops.inv_norm import rms_norm_fwd, rms_norm_ref


class RsqrtFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):
        r = torch.rsqrt(u)  # (..., 1)
        ctx.save_for_backward(r)
        return r

    @staticmethod
    def backward(ctx, g):
        (r,) = ctx.saved_tensors
        return -0.5 * ((g * r) * r) * r  # = -½·g·r³, without forming r³


def rsqrt(u: torch.Tensor) -> torch.Tensor:
    """``torch.rsqrt(u)`` whose backward does not underflow for large ``u`` (see above)."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and u.requires_grad):
        return torch.rsqrt(u)  # compiled: the graph's own backward (a Function would break it)
    with sites.role("rsqrt"):
        return RsqrtFunction.apply(u)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_fwd(x, weight, eps)  # rstd: (..., 1) fp32
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(x, rstd, *(() if weight is None else (weight,)))
        return y

    @staticmethod
    def backward(ctx, dy):
        # x, dy: (..., d); rstd: (..., 1) fp32; weight: (d,)
        x, rstd, *w = ctx.saved_tensors
        w = w[0] if w else None
        xhat = x.float() * rstd  # (..., d) fp32
        g = dy.float() if w is None else dy.float() * w.float()  # dL/dx̂ (..., d)
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))  # (..., d)
        dw = None
        if w is not None and ctx.needs_input_grad[1]:
            xh = xhat.to(ctx.x_dtype).to(torch.promote_types(ctx.x_dtype, w.dtype))
            dw = (dy.to(xh.dtype) * xh).reshape(-1, x.shape[-1]).float().sum(0).to(w.dtype)
        return dx.to(ctx.x_dtype), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm saving (x, rstd): same forward as :func:`rms_norm_ref`, one saved (…, d) tensor."""
    if not x.is_floating_point():
        raise ValueError(f"rms_norm needs a floating-point input, got {x.dtype}")
    if not (torch.is_grad_enabled() and (x.requires_grad or getattr(weight, "requires_grad", 0))):
        return rms_norm_ref(x, weight, eps)
    with sites.role("rms_norm"):
        return RMSNormFunction.apply(x, weight, eps)


__all__ = ["RMSNormFunction", "RsqrtFunction", "rms_norm", "rms_norm_ref", "rsqrt"]
