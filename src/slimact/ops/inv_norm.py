"""Inverted norms: RMSNorm / LayerNorm that save their *output* and the per-row rstd, not x.

A norm feeds a Linear (q/k/v, gate/up, c_attn, c_fc) that saves the norm's output ``y`` anyway,
yet autograd's RMSNorm also keeps ``x`` and ``x̂`` (2nd extra, slimact's ``RMSNorm`` is written op
by op), and ``F.layer_norm`` keeps ``x`` (1nd). Both backwards only need ``x̂`` and ``rstd``:

    RMSNorm   y = w ⊙ x̂,      x̂ = x·rstd,            rstd = (mean(x²) + eps)^-½
    LayerNorm y = w ⊙ x̂ + b,  x̂ = (x − μ)·rstd,      rstd = (var(x) + eps)^-½
    g  = w ⊙ dy                                          (dL/dx̂)
    dx = rstd · (g − x̂·mean(g ⊙ x̂))                      (RMSNorm)
    dx = rstd · (g − mean(g) − x̂·mean(g ⊙ x̂))            (LayerNorm; μ is not needed)
    dw = Σ_rows dy ⊙ x̂,   db = Σ_rows dy

and ``x̂ = (y − b) / w`` is recovered from the saved output (Tempo's in-place LayerNorm idea).
Saved: ``y`` (shared with the next Linear, counted once) + fp32 rstd (n values): −2nd (our
RMSNorm) / −1nd (LayerNorm) per norm. The forward is computed with the very ops of the original
module, so the output is bit-identical.

When is ``y / w`` safe? ``y = fl(w·x̂)`` carries ``x̂`` to relative round-off unless ``w·x̂`` falls
below the dtype's normal range, so the weight must satisfy ``|w| ≥ √tiny(dtype)`` (1.1e-19 for
fp32/bf16, 7.8e-3 for fp16) and be finite; ``w = 0`` loses ``x̂`` outright (yet ``dx`` and ``dw``
need it). A bias adds absolute error ``ε·|b|/|w|``, so LayerNorm also needs
``|b|/|w| ≤ max_bias_ratio``. :func:`invertible` checks this on every call (d values; one host
read, a sync on GPU) and otherwise the op runs the ordinary autograd formula under the site role
``inv_*_fallback`` (the meter shows it per site). The modules (``slimact.modules.inv_act``)
check on the host once, then each new version of the weights (an optimizer step) on the device
(:func:`invertible_stats`), read at a later call without waiting for the device
(``slimact.ops.deferred``), so a training step does not sync. Until that verdict is read the
weight is taken as invertible still; should it no longer be, the backward divides by NaN where
``|w|`` is below the floor or not finite (:func:`guarded`): NaN out, never a wrong finite value,
and the next call takes the fallback.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slimact import sites

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEFAULT_MAX_BIAS_RATIO = 4.0


def _check_float(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{what} needs a floating-point tensor, got dtype {x.dtype}")


def weight_floor(dtype: torch.dtype) -> float:
    """Smallest |w| for which y / w recovers x̂ to round-off: √(smallest normal of dtype)."""
    return math.sqrt(torch.finfo(dtype).tiny)


def invertible_stats(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Device float64 ``[all |w| finite, min |w|, max |b|/|w|]`` (no sync; the ratio 0 without
    a bias): what :func:`invertible_reason` reads."""
    with torch.no_grad():
        w = weight.detach().abs().float()
        one = torch.ones((), dtype=torch.float32, device=w.device)
        finite = torch.isfinite(w).all().float() if w.numel() else one
        wmin = w.amin() if w.numel() else one
        ratio = torch.zeros_like(one)
        if bias is not None and bias.numel():
            ratio = (bias.detach().abs().float() / w).amax()
        stats = torch.stack([finite, wmin, ratio]).double()
        # a sharded weight (FSDP2's DTensor): the statistics of the whole weight, every rank
        return stats.full_tensor() if hasattr(stats, "full_tensor") else stats


def invertible_reason(
    values: list[float], dtype: torch.dtype, max_bias_ratio: float = DEFAULT_MAX_BIAS_RATIO
) -> str | None:
    """None if x̂ can be recovered from y, given :func:`invertible_stats`' values; otherwise the
    reason (for the per-site report)."""
    finite, wmin, ratio = values
    if not finite:
        return "weight has non-finite entries"
    floor = weight_floor(dtype if dtype != torch.float64 else torch.float64)
    if wmin < floor:
        return f"min |weight| = {wmin:.3g} < {floor:.3g} ({dtype}): y / w would lose x̂"
    if not math.isfinite(ratio) or ratio > max_bias_ratio:
        return f"max |bias|/|weight| = {ratio:.3g} > {max_bias_ratio}: (y-b)/w too lossy"
    return None


def invertible(
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    max_bias_ratio: float = DEFAULT_MAX_BIAS_RATIO,
) -> str | None:
    """None if x̂ can be recovered from y; otherwise the reason (for the per-site report). One
    host read of :func:`invertible_stats` (a sync on a GPU)."""
    if weight is None:
        return None
    return invertible_reason(invertible_stats(weight, bias).tolist(), dtype, max_bias_ratio)


def guarded(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``w`` with NaN where ``y / w`` cannot recover x̂ (below the floor, or not finite):
    a backward that divides by it gives NaN there, never a wrong finite value. The identity on a
    weight :func:`invertible` accepts."""
    wf = w.float()
    ok = (wf.abs() >= weight_floor(dtype)) & torch.isfinite(wf)
    return torch.where(ok, wf, float("nan"))


# ----------------------------------------------------------------------------- RMSNorm
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """slimact's / Hugging Face LLaMA's RMSNorm, op by op (the exact reference)."""
    dtype = x.dtype
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = (xf * rstd).to(dtype)
    return xhat if weight is None else weight * xhat


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of :func:`rms_norm_ref`, rstd (..., 1) in fp32: the shared forward of the fused
    norms (this module's output-saving one and ``ops/rms_norm``'s input-saving one)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
    xhat = (xf * rstd).to(x.dtype)
    return (xhat if weight is None else weight * xhat), rstd


class InvRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        dtype = x.dtype
        y, rstd = rms_norm_fwd(x, weight, eps)
        ctx.has_w = weight is not None
        ctx.x_dtype = dtype
        if weight is None:
            ctx.save_for_backward(y, rstd)
        else:
            ctx.save_for_backward(y, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        # y, dy: (..., d); rstd: (..., 1) fp32; weight: (d,)
        y, rstd, *w = ctx.saved_tensors
        w = w[0] if w else None
        yf, dyf = y.float(), dy.float()
        xhat = yf if w is None else yf / guarded(w, ctx.x_dtype)  # (..., d)
        g = dyf if w is None else dyf * w.float()  # dL/dx̂ (..., d)
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = None
        if w is not None and ctx.needs_input_grad[1]:
            xh = xhat.to(ctx.x_dtype).to(torch.promote_types(ctx.x_dtype, w.dtype))
            dw = (dy.to(xh.dtype) * xh).reshape(-1, y.shape[-1]).float().sum(0).to(w.dtype)
        return dx.to(ctx.x_dtype), dw, None


def inv_rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *, check: bool = True
) -> torch.Tensor:
    """RMSNorm whose backward reads the output: same forward as :func:`rms_norm_ref`."""
    _check_float(x, "inv_rms_norm")
    if not (torch.is_grad_enabled() and (x.requires_grad or _req(weight))):
        return rms_norm_ref(x, weight, eps)
    if check:
        reason = invertible(weight, None, x.dtype)
        if reason is not None:
            with sites.role("inv_rms_norm_fallback"):
                return rms_norm_ref(x, weight, eps)
    with sites.role("inv_rms_norm"):
        return InvRMSNormFunction.apply(x, weight, eps)


def _req(t: torch.Tensor | None) -> bool:
    return t is not None and t.requires_grad


# ----------------------------------------------------------------------------- LayerNorm
class InvLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        y = F.layer_norm(x, normalized_shape, weight, bias, eps)  # bit-identical output
        k = len(normalized_shape)
        dims = tuple(range(x.dim() - k, x.dim()))
        var = x.float().var(dim=dims, unbiased=False, keepdim=True)
        rstd = torch.rsqrt(var + eps)  # (..., 1, ..., 1) fp32
        ctx.k, ctx.x_dtype = k, x.dtype
        ctx.has_w, ctx.has_b = weight is not None, bias is not None
        ctx.save_for_backward(y, rstd, *(t for t in (weight, bias) if t is not None))
        return y

    @staticmethod
    def backward(ctx, dy):
        # y, dy: (..., *normalized_shape); rstd: (..., 1...) fp32; weight, bias: normalized_shape
        y, rstd, *wb = ctx.saved_tensors
        w = wb.pop(0) if ctx.has_w else None
        b = wb.pop(0) if ctx.has_b else None
        dims = tuple(range(y.dim() - ctx.k, y.dim()))
        yf, dyf = y.float(), dy.float()
        xhat = yf - b.float() if b is not None else yf
        if w is not None:
            xhat = xhat / guarded(w, ctx.x_dtype)
        g = dyf * w.float() if w is not None else dyf
        dx = rstd * (g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True))
        lead = tuple(range(y.dim() - ctx.k))
        dw = db = None
        if w is not None and ctx.needs_input_grad[2]:
            dw = (dyf * xhat).sum(lead).to(w.dtype) if lead else (dyf * xhat).to(w.dtype)
        if b is not None and ctx.needs_input_grad[3]:
            db = dyf.sum(lead).to(b.dtype) if lead else dyf.to(b.dtype)
        return dx.to(ctx.x_dtype), None, dw, db, None


def inv_layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    max_bias_ratio: float = DEFAULT_MAX_BIAS_RATIO,
    check: bool = True,
) -> torch.Tensor:
    """Drop-in for ``F.layer_norm`` whose backward reads the output (falls back when unsafe)."""
    _check_float(x, "inv_layer_norm")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"normalized_shape {shape} does not match x's trailing dims {x.shape}")
    if not (torch.is_grad_enabled() and (x.requires_grad or _req(weight) or _req(bias))):
        return F.layer_norm(x, shape, weight, bias, eps)
    if check:
        reason = invertible(weight, bias, x.dtype, max_bias_ratio)
        if reason is not None:
            with sites.role("inv_layer_norm_fallback"):
                return F.layer_norm(x, shape, weight, bias, eps)
    with sites.role("inv_layer_norm"):
        return InvLayerNormFunction.apply(x, shape, weight, bias, eps)
