"""f'(f⁻¹(y)): the derivative of GELU / tanh-GELU / SiLU recovered from the output and 1 bit.

GELU (``x·Φ(x)``), its tanh form (``x·σ(2u)``, ``u = √(2/π)(x + 0.044715x³)``) and SiLU
(``x·σ(x)``) each fall, then rise: they have one minimum at ``T`` (the branch point) with value
``f(T) < 0``. Given ``y = f(x)`` and the bit ``s = [x < T]`` the input is unique, so the backward
``dx = dy·f'(x)`` can be computed as ``dy·f'(f⁻¹(y; s))`` without keeping ``x`` (invact.txt §2).

Two ways to get ``g(y, s) = f'(f⁻¹(y; s))`` live here, as plain-PyTorch references; the Triton
kernels in ``slimact.ops.inv_act`` mirror them step for step.

``mode="paper"`` — the paper's closed forms, Eqs. 5–8 with the App. A.2 coefficients, in
``ỹ = y − f(T)``. One evaluation, no iteration. Reading App. A.2 literally does not work for SiLU:
its "q_left" table has five coefficients and "q_right" four, while Eq. 7 (x<T) takes four and
Eq. 8 (x≥T) five; swapping the labels reproduces the paper's Fig. 2 curves (checked numerically,
see tests). The paper has no tanh-GELU fit; ``paper`` uses the erf-GELU fit there.

``mode="newton"`` (the default) — solve ``f(x) = y`` on the branch ``s`` and evaluate the exact
``f'(x)``:

* near the branch point the root is a square-root singularity of ``f⁻¹``, so Newton runs on
  ``F(x) = ±√(f(x) − f(T))``, which is smooth with slope ``√(C/2)`` at ``T`` (``C = f''(T)``),
  from the guess ``x₀ = T ± √(2ỹ/C)`` (exact to first order);
* on the left tail (``s = 1`` and ``y > f(T)/2``) ``f`` flattens exponentially, so Newton runs
  on ``log(−f(x)) = log(−y)``, which is close to linear (SiLU) or quadratic (GELU) in ``x``.

``NEWTON_ITERS = 3`` steps reach fp32 round-off everywhere (measured: BENCHMARKS.md §2).
What remains is *conditioning*, not approximation: near ``T``, ``f'`` ≈ ``√(2C·ỹ)``, so rounding
``y`` to its dtype (half an ulp of |f(T)| ≈ 0.17) moves the answer by up to ``√(C·ulp)``: ≈1e-4
in fp32, ≈2e-2 in bf16. No 1-bit scheme can beat that; exact autograd reads the unrounded ``x``.

Default: ``newton``. Measured on [−10, 10] (fp32 y): paper L∞ 1.9e-2 (GELU, at T) / 2.9e-3
(SiLU), newton L∞ ≈ 1e-4 (the conditioning floor) and L2 ~100× lower than paper's. Its cost
is ~3× the transcendental work of ``paper``, invisible on GPU (the kernel is bandwidth-bound)
and a few % of a CPU MLP step. The issue's bar (L∞ ≤ 1e-3 in fp32) rules ``paper`` out anyway.

The compiled CPU path does not iterate: ``newton_table`` tabulates g once per kind (the
float64 Newton solve at 3 × 4097 nodes: over u = √(y − f(T)) on each branch, and g/y over
log(−y) on the left tail) and ``dinv_table`` interpolates linearly (1 sqrt, 1 log, 2 reads per
element; interpolation error < 1e-6, same L∞ as ``newton`` on the grid above). Eager Newton with
3 steps cost ~47 transcendentals per element, ~20× a SiLU backward even when compiled.

Special values follow torch: ``y`` NaN -> NaN; ``y = +inf`` (x = +inf) -> 1; ``y == 0`` on the
left branch (x so negative that f(x) underflowed) -> 0, the limit of ``f'`` there.

Extreme magnitudes need no fallback: on the right branch ``f(x) → x`` and Newton
starts from ``max(x₀, y)``, so ``f'`` is recovered up to the dtype's max, and far left ``y``
underflows to the 0 case above; measured against torch's autograd from 1e3 to ``finfo.max`` and
down to −``finfo.max`` in fp32 and bf16 (``tests/test_extreme_values.py``). The one difference:
tanh-GELU's ``x³`` overflows fp32 above |x| ≈ 1e13, where torch's own backward is NaN; ours is
NaN on the right too (the table path: the true limit 1) and the true limit 0 on the left. (In a model with a 1e20 weight, ``invact``
disagrees with fp32 autograd, and it is autograd that is wrong: the RMSNorm's ``rsqrt`` backward
underflows ``rstd³``; against the float64 truth ``invact`` has cosine 1.0.)
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KINDS = ("gelu", "gelu_tanh", "silu")
MODES = ("newton", "paper")
NEWTON_ITERS = 3  # fp32 / bf16 / fp16 compute (fp32 math); fp64 uses NEWTON_ITERS_F64
NEWTON_ITERS_F64 = 6

SQRT1_2 = 0.7071067811865476
INV_SQRT_2PI = 0.3989422804014327
TANH_K0 = 0.7978845608028654  # √(2/π)
TANH_K1 = 0.044715


@dataclass(frozen=True)
class Branch:
    """Branch point T, f(T) split as hi + lo (fp32 + remainder), C = f''(T), K = √(2/C)."""

    T: float
    fT: float
    C: float
    # fT rounded to fp32 (nearest) and the remainder: computed once here, plain floats in the
    # traced code (torch 2.13's dynamo recursed without end through its struct.pack polyfill
    # when this rounding ran inside a compiled ref, and the CPU path silently fell back to eager)
    fT_hi: float = field(init=False)
    fT_lo: float = field(init=False)

    def __post_init__(self) -> None:
        hi = struct.unpack("f", struct.pack("f", self.fT))[0]
        object.__setattr__(self, "fT_hi", hi)
        object.__setattr__(self, "fT_lo", self.fT - hi)

    @property
    def K(self) -> float:
        return math.sqrt(2.0 / self.C)


# T solves f'(T) = 0; computed in float64 by bisection (tests re-derive them).
BRANCH = {
    "gelu": Branch(-0.7517915246935645, -0.16997120747990369, 0.43149399213182615),
    "gelu_tanh": Branch(-0.7524614220710163, -0.17004075057125403, 0.4304000908668393),
    "silu": Branch(-1.2784645427610741, -0.27846454276107374, 0.21781170590859628),
}

# invact.txt App. A.2. GELU: Eq. 5 (x<T, 8 coefficients), Eq. 6 (x≥T, 5 coefficients).
PAPER_GELU_LEFT = (
    1.6311011311381,
    0.16997246666667,
    -0.06261728,
    1.2947087,
    1.98055565,
    0.22730362,
    -0.038978495,
    1.3295193,
)
PAPER_GELU_RIGHT = (
    -1.383717971214795,
    1.558420184350027,
    0.044045748018110,
    0.032146736769376,
    -2.119885089843949,
)
# SiLU: the 4-coefficient set fits Eq. 7 (x<T), the 5-coefficient set Eq. 8 (x≥T); App. A.2
# prints them under the opposite labels (see module docstring).
PAPER_SILU_LEFT = (
    0.217177007595768,
    -0.507684370508263,
    0.079631397669175,
    0.357494204859375,
)
PAPER_SILU_RIGHT = (
    -1.310856402130980,
    0.848589647031652,
    -0.162990512595109,
    0.002696163985044,
    -5.770613302664509,
)


def act_ref(x: torch.Tensor, kind: str) -> torch.Tensor:
    """torch's own forward (the exact reference)."""
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


def check_kind_mode(kind: str, mode: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _log_sigmoid(z: torch.Tensor) -> torch.Tensor:
    return torch.clamp(z, max=0.0) - torch.log1p(torch.exp(-z.abs()))


def f_q_df(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(f(x), q(x) = f(x)/x, f'(x)) in x's dtype, written as the kernels compute them."""
    if kind == "gelu":
        q = 0.5 * (1.0 + torch.erf(x * SQRT1_2))
        df = q + x * torch.exp(-0.5 * x * x) * INV_SQRT_2PI
    elif kind == "gelu_tanh":
        u = TANH_K0 * (x + TANH_K1 * x * x * x)
        q = torch.sigmoid(2.0 * u)
        df = q + x * 2.0 * q * (1.0 - q) * TANH_K0 * (1.0 + 3.0 * TANH_K1 * x * x)
    else:
        q = torch.sigmoid(x)
        df = q * (1.0 + x * (1.0 - q))
    return x * q, q, df


def log_q(x: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """log(f(x)/x), stable on the left tail for the sigmoid forms."""
    if kind == "gelu":
        return torch.log(q)
    if kind == "gelu_tanh":
        return _log_sigmoid(2.0 * TANH_K0 * (x + TANH_K1 * x * x * x))
    return _log_sigmoid(x)


def dinv_paper_ref(y: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
    """Paper Eqs. 5–8: g(y, s) ≈ f'(f⁻¹(y; s)); s is a bool tensor [x < T]."""
    if kind == "silu":
        t = torch.clamp(y - BRANCH["silu"].fT, min=0.0)
        rt = torch.sqrt(t)
        c = PAPER_SILU_LEFT
        left = (c[0] + c[1] * rt + c[2] * t + c[3] * t * t) * (1.0 - y) + y
        c = PAPER_SILU_RIGHT
        sig = 1.0 + (c[0] + c[1] * rt + c[2] * t) * torch.exp(c[3] * (c[4] - t) ** 3)
        right = sig * (1.0 - y) + y
    else:  # both GELU forms use the erf-GELU fit
        t = torch.clamp(y - BRANCH["gelu"].fT, min=0.0)
        rt = torch.sqrt(t)
        c = PAPER_GELU_LEFT
        inner = torch.abs(c[3] * y * y + torch.abs(c[4] * y + c[5]) + c[6]) + c[7]
        yl = torch.clamp(y, max=0.0)
        left = (
            c[0] * torch.sqrt(torch.clamp(y + c[1], min=0.0)) * (2.0 * yl + c[2] * torch.sqrt(-yl))
        )
        left = left * inner
        c = PAPER_GELU_RIGHT
        right = 1.0 + (c[0] + c[1] * rt + c[2] * t) * torch.exp(c[3] * (c[4] - t) ** 3)
    out = torch.where(s, left, right)
    out = torch.where(s & (y >= 0), torch.zeros_like(out), out)  # underflowed left tail
    return torch.where(torch.isposinf(y), torch.ones_like(out), out)


def _tail_guess(L: torch.Tensor, kind: str) -> torch.Tensor:
    """x on the left tail from L = log(−y): GELU y ≈ −φ(x), SiLU y ≈ x·eˣ."""
    if kind == "silu":
        return L - torch.log(torch.clamp(-L, min=1.0))
    return -torch.sqrt(torch.clamp(-2.0 * L - math.log(2.0 * math.pi), min=1.0))


def _sqrt_solve(yc: torch.Tensor, s: torch.Tensor, b: Branch, kind: str, iters: int):
    """Newton on F(x) = ±√(f(x) − f(T)) = ±√ỹ: the right branch and the left one near T."""
    r = torch.sqrt(torch.clamp((yc - b.fT_hi) - b.fT_lo, min=0.0))
    sign = torch.where(s, -1.0, 1.0).to(yc.dtype)
    x = b.T + sign * b.K * r  # exact to first order in x − T
    x = torch.where(~s & (yc > 0), torch.maximum(x, yc), x)
    for _ in range(iters):
        fx, _, g = f_q_df(x, kind)
        F = sign * torch.sqrt(torch.clamp((fx - b.fT_hi) - b.fT_lo, min=0.0))
        ratio = torch.where(g.abs() > 1e-6, 2.0 * F / g, torch.full_like(x, b.K))  # 1/F'(x)
        x = x - (F - sign * r) * ratio
        x = torch.where(s, torch.clamp(x, max=b.T), torch.clamp(x, min=b.T))
    return x


def _tail_solve(yc: torch.Tensor, b: Branch, kind: str, iters: int):
    """Newton on log(−f(x)) = log(−y) for the left tail."""
    L = torch.log(torch.clamp(-yc, min=torch.finfo(yc.dtype).tiny))
    x = torch.clamp(_tail_guess(L, kind), max=b.T)
    for _ in range(iters):
        fx, q, g = f_q_df(x, kind)
        resid = torch.log(-x) + log_q(x, q, kind) - L
        step = resid * fx / g  # resid / (d/dx log(−f)) = resid · f / f'
        step = torch.where(torch.isfinite(step), step, torch.full_like(x, -0.5))
        x = torch.clamp(x - step, max=b.T)
    return x


def dinv_newton_ref(y: torch.Tensor, s: torch.Tensor, kind: str, iters: int | None = None):
    """Newton-refined f⁻¹ (see module docstring), then the exact f'. Computes in fp32 (fp64 for
    fp64 y) and returns that dtype. Each solver runs only on the elements that need it (the
    Triton kernel evaluates both and selects; the arithmetic per element is the same)."""
    cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
    if iters is None:
        iters = NEWTON_ITERS_F64 if cdt == torch.float64 else NEWTON_ITERS
    b = BRANCH[kind]
    yc = y.to(cdt).reshape(-1)
    s = s.reshape(-1)
    tail = s & (yc > 0.5 * b.fT)
    x = torch.empty_like(yc)
    near = ~tail
    x[near] = _sqrt_solve(yc[near], s[near], b, kind, iters)
    if bool(tail.any()):
        x[tail] = _tail_solve(yc[tail], b, kind, iters)
    out = f_q_df(x, kind)[2]
    out = torch.where(s & (yc >= 0), torch.zeros_like(out), out)  # underflowed left tail
    out = torch.where(torch.isposinf(yc), torch.ones_like(out), out)
    return torch.where(torch.isnan(yc), yc, out).view(y.shape)


# ----------------------------------------------------------------------------- table form
TABLE_SEGMENTS = 4096  # linear pieces per region (3 regions): 48 KiB of fp32 per kind
TABLE_U_RIGHT = 4.6  # right branch: u = √(y − f(T)) ≤ 4.6 (y ≤ 20.9); beyond it f' = 1 in fp32
_TABLES: dict[str, torch.Tensor] = {}


def _regions(kind: str) -> tuple[tuple[float, float], ...]:
    """(lo, hi) of the coordinate per region: right u, left u (near T), tail v = log(−y)."""
    fT = BRANCH[kind].fT
    tiny = torch.finfo(torch.float32).tiny
    return (
        (0.0, TABLE_U_RIGHT),
        (0.0, math.sqrt(-0.5 * fT)),
        (math.log(tiny), math.log(-0.5 * fT)),
    )


def newton_table(kind: str) -> torch.Tensor:
    """(3·(TABLE_SEGMENTS + 1),) fp32 node values, region by region: g = f'(f⁻¹(y)) over
    u = √(y − f(T)) on the right branch and on the left one near T, and g / y over v = log(−y)
    on the left tail; from the float64 Newton solve (12 steps). Built once per kind, on use."""
    if kind not in _TABLES:
        n, b = TABLE_SEGMENTS, BRANCH[kind]
        rows = []
        for region, (lo, hi) in enumerate(_regions(kind)):
            t = torch.linspace(lo, hi, n + 1, dtype=torch.float64)
            y = -torch.exp(t) if region == 2 else b.fT + t * t
            g = dinv_newton_ref(y, torch.full_like(y, region > 0, dtype=torch.bool), kind, 12)
            rows.append(g / y if region == 2 else g)
        _TABLES[kind] = torch.cat(rows).float()
    return _TABLES[kind]


def dinv_table(y: torch.Tensor, s: torch.Tensor, kind: str, table: torch.Tensor) -> torch.Tensor:
    """g(y, s) by linear interpolation in :func:`newton_table` (one sqrt, one log, two table
    reads; interpolation error < 1e-6, under fp32's conditioning floor): the pointwise form
    inductor compiles for the CPU path (``compiled_ref``). fp32 in and out."""
    b, n = BRANCH[kind], TABLE_SEGMENTS
    if table.shape != (3 * (n + 1),):  # the reads below are unchecked
        raise ValueError(f"table must be newton_table(kind), shape {(3 * (n + 1),)}: {table.shape}")
    (_, ur), (_, ul), (v0, v1) = _regions(kind)
    yc = y.float()
    u = torch.sqrt(torch.clamp((yc - b.fT_hi) - b.fT_lo, min=0.0))
    v = torch.log(torch.clamp(-yc, min=torch.finfo(torch.float32).tiny))
    tail = s & (yc > 0.5 * b.fT)
    pos = torch.where(tail, (v - v0) * (n / (v1 - v0)), u * torch.where(s, n / ul, n / ur))
    pos = torch.clamp(torch.nan_to_num(pos, nan=0.0), min=0.0, max=n - 1e-3)  # a valid index
    seg = torch.floor(pos)
    t = pos - seg
    idx = seg.to(torch.int64) + torch.where(tail, 2 * (n + 1), torch.where(s, n + 1, 0))
    # idx, idx + 1 lie in [0, 3n + 2] by construction (pos clamped, NaN mapped to 0): the unchecked
    # read spares inductor's per-lane bounds check and negative wrap (BENCHMARKS.md §2)
    lo = torch.ops.aten._unsafe_index(table, [idx])
    p = lo + t * (torch.ops.aten._unsafe_index(table, [idx + 1]) - lo)
    out = torch.where(tail, p * yc, p)
    out = torch.where(~s & (u >= ur), 1.0, out)
    out = torch.where(s & (yc >= 0), 0.0, out)
    return torch.where(torch.isnan(yc), yc, out)


def dinv_ref(y: torch.Tensor, s: torch.Tensor, kind: str, mode: str = "newton") -> torch.Tensor:
    """g(y, s) = f'(f⁻¹(y; s)) in the compute dtype (fp32, or fp64 for fp64 y)."""
    check_kind_mode(kind, mode)
    if mode == "paper":
        cdt = torch.float64 if y.dtype == torch.float64 else torch.float32
        return dinv_paper_ref(y.to(cdt), s, kind)
    return dinv_newton_ref(y, s, kind)


def exact_df(x: torch.Tensor, kind: str) -> torch.Tensor:
    """f'(x) by autograd through torch's own ops (the reference every mode is held to)."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(act_ref(x, kind).sum(), x)
    return g
