"""g(y, s) = f'(f⁻¹(y; s)) as piecewise Chebyshev polynomials: the compiled CPU backward.

``inv_act_approx.dinv_table`` interpolated a 3 x 4097-node table: on CPU, inductor runs its two
gathers lane by lane (plus the int64 index math and two scalar ``isnan`` loops), ~11 ns per
element, ~20x torch's own SiLU backward on llama-20m's MLP. Here the same function is a few
polynomial pieces in the same coordinates: each lane blends its piece's coefficients (constants,
no gather), then one Horner chain; one ``sqrt`` and one ``log`` per element, all vectorized.

Coordinates (as the table's), with ``ỹ = y − f(T)`` and ``y_b = Y_SPLIT·f(T)``:

* right branch (``s = 0``): ``u = √ỹ`` on ``[0, U_RIGHT]`` (beyond it ``f' = 1`` in fp32), cut
  into pieces (``PIECES``; SiLU 2, the GELU forms 3: their ``f'`` turns to 1 faster);
* left branch near T (``s = 1``, ``y ≤ y_b``): ``u = √ỹ`` on ``[0, √(y_b − f(T))]``;
* left tail (``s = 1``, ``y > y_b``): ``g / y`` over ``v = log(−y)`` on ``[V_LOW, log(−y_b)]``, fitted
  with weight ``|y|`` (what is tested is the absolute error of g = y·(g/y)); below ``V_LOW`` v is
  clamped: ``|y| < e⁻¹⁸``, so ``|Δg| ≤ |y|·|Δ(g/y)| < 2e-7``.

In ``u`` the square-root singularity of ``f⁻¹`` at T is gone (``g ≈ √(2C)·u`` there), so each
piece is smooth and a degree-``DEGREE`` Chebyshev series fits it to ≤ 2e-6 absolute (SiLU 1e-7),
under fp32's conditioning floor (≈1e-4 near T: half an ulp of y moves f' by √(C·ulp)). The
series are least-squares fits, in float64, of ``inv_act_approx.dinv_newton_ref`` (12 Newton
steps: the reference itself) at 2000 Chebyshev nodes per piece, built once per kind on first
use (:func:`poly_coeffs`), in monomials of a per-piece ``t`` (``[−1, 1]`` on u pieces, where their
coefficients sum to ≤ 3.2 in absolute value; ``[−1, 0]`` from the tail's top, where |y| is
largest), so fp32 Horner adds < 1e-6.

Special values as the table's: NaN -> NaN, ``y = +inf`` -> 1, ``y ≥ 0`` on the left branch (an
underflowed tail) -> 0. NaN is tested as ``y != y``: inductor vectorizes the compare, while
``isnan`` became a scalar loop.
"""

from __future__ import annotations

import math

import torch

from slimact.ops.inv_act_approx import BRANCH, KINDS, dinv_newton_ref

DEGREE = 14
NODES = 2000
U_RIGHT = 4.6  # as inv_act_approx.TABLE_U_RIGHT: u >= 4.6 -> f' = 1 in fp32
Y_SPLIT = 0.25  # left branch: u-series for y <= 0.25·f(T), tail series in log(-y) above
V_LOW = -18.0
# right-branch breakpoints in u, per kind
PIECES = {
    "silu": (0.0, 2.3, U_RIGHT),
    "gelu": (0.0, 1.2, 2.3, U_RIGHT),
    "gelu_tanh": (0.0, 1.2, 2.3, U_RIGHT),
}
_COEFFS: dict[str, torch.Tensor] = {}


def intervals(kind: str) -> tuple[tuple[float, float], ...]:
    """(lo, hi) of every piece: the right branch's (in u), the left one near T (u), the tail
    (v = log(−y)); :func:`poly_coeffs` rows follow this order."""
    fT = BRANCH[kind].fT
    br = PIECES[kind]
    right = tuple(zip(br[:-1], br[1:], strict=True))
    return (*right, (0.0, math.sqrt((Y_SPLIT - 1.0) * fT)), (V_LOW, math.log(-Y_SPLIT * fT)))


def _frame(i: int, lo: float, hi: float, n: int) -> tuple[float, float]:
    """(center, scale) of piece i: t = (z − center)·scale spans [−1, 1] on a u piece, [−1, 0]
    on the tail (expanded at its top, where |y| is largest, so Horner's rounding is smallest
    where it counts)."""
    if i == n - 1:
        return hi, 1.0 / (hi - lo)
    return 0.5 * (lo + hi), 2.0 / (hi - lo)


def _truth(z: torch.Tensor, kind: str, piece: int, n_pieces: int) -> torch.Tensor:
    """What piece ``piece`` fits at coordinates z: g (u pieces) or g / y (the tail)."""
    b = BRANCH[kind]
    left = piece >= n_pieces - 2
    y = -torch.exp(z) if piece == n_pieces - 1 else b.fT + z * z
    g = dinv_newton_ref(y, torch.full_like(y, left, dtype=torch.bool), kind, 12)
    return g / y if piece == n_pieces - 1 else g


def poly_coeffs(kind: str) -> torch.Tensor:
    """(pieces, DEGREE + 1) fp32 monomial coefficients in each piece's t (:func:`_frame`),
    constant term first, rows as :func:`intervals`; fitted once per kind on first use (float64
    least squares at Chebyshev nodes; the tail weighted by |y|)."""
    if kind not in _COEFFS:
        spans = intervals(kind)
        k = torch.arange(NODES, dtype=torch.float64)
        x = torch.cos(math.pi * (k + 0.5) / NODES)  # Chebyshev nodes on [-1, 1]
        rows = []
        for i, (lo, hi) in enumerate(spans):
            z = lo + (x + 1.0) * (0.5 * (hi - lo))
            center, scale = _frame(i, lo, hi, len(spans))
            V = ((z - center) * scale)[:, None] ** torch.arange(DEGREE + 1, dtype=torch.float64)
            w = torch.exp(z) if i == len(spans) - 1 else torch.ones_like(z)
            target = _truth(z, kind, i, len(spans))
            rows.append(torch.linalg.lstsq(V * w[:, None], (target * w)[:, None]).solution[:, 0])
        _COEFFS[kind] = torch.stack(rows).float()
    return _COEFFS[kind]


def poly_floats(kind: str) -> tuple[tuple[float, ...], ...]:
    """:func:`poly_coeffs` as Python floats (fp32 values): what :func:`dinv_poly` takes, so
    that the compiled loop holds them as literals (as a tensor, every coefficient was a load
    and a broadcast per vector: the loop could not hoist them past its stores)."""
    return tuple(tuple(row) for row in poly_coeffs(kind).tolist())


def dinv_poly(y: torch.Tensor, s: torch.Tensor, kind: str, coeffs) -> torch.Tensor:
    """g(y, s) ≈ f'(f⁻¹(y; s)) from :func:`poly_floats` (``coeffs``); y any float dtype, s bool
    of y's shape; fp32 out. Pointwise: what inductor compiles for the CPU backward. Each lane
    picks its piece's coefficients (blends of constants), then one Horner chain."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    spans = intervals(kind)
    n = len(spans)
    if len(coeffs) != n or any(len(row) != DEGREE + 1 for row in coeffs):
        raise ValueError(f"coeffs must be poly_floats(kind): {n} rows of {DEGREE + 1}")
    b = BRANCH[kind]
    yc = y.float()
    u = torch.sqrt(torch.clamp((yc - b.fT_hi) - b.fT_lo, min=0.0))
    v = torch.log(torch.clamp(-yc, min=torch.finfo(torch.float32).tiny))
    tail = s & (yc > Y_SPLIT * b.fT)
    # piece masks, last (the tail) first: where() chains below pick the first that holds
    masks = [tail, s] + [u >= spans[i][0] for i in range(n - 3, 0, -1)]
    order = [n - 1, n - 2] + list(range(n - 3, 0, -1))  # the pieces the masks select

    def pick(vals: list) -> torch.Tensor:  # vals[i] for piece i; piece 0 when no mask holds
        out = vals[0]
        for m, i in zip(reversed(masks), reversed(order), strict=True):
            out = torch.where(m, vals[i], out)
        return out

    frames = [_frame(i, lo, hi, n) for i, (lo, hi) in enumerate(spans)]
    z = torch.where(tail, v, u)
    t = (z - pick([c for c, _ in frames])) * pick([sc for _, sc in frames])
    t = torch.clamp(t, min=-1.0, max=1.0)
    p = pick([coeffs[i][DEGREE] for i in range(n)])
    for k in range(DEGREE - 1, -1, -1):
        p = p * t + pick([coeffs[i][k] for i in range(n)])
    out = torch.where(tail, p * yc, p)
    out = torch.where(~s & (u >= U_RIGHT), 1.0, out)
    out = torch.where(s & (yc >= 0), 0.0, out)
    return torch.where(yc != yc, yc, out)


__all__ = ["DEGREE", "PIECES", "dinv_poly", "intervals", "poly_coeffs"]
