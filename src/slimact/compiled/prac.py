"""PRAC inside torch.compile: principal + random subspace compression as a traced pack/unpack.

The math is ``codecs/prac.py``'s (prac.txt §4–5): with X the saved tensor as tokens × n, an
orthonormal Q1 (n × r1) spanning X's top right-singular directions and an orthonormal Q2
(n × r2) drawn uniformly in Q1's complement, the pack stores

    Z = [XQ1, k·XQ2]  (tokens × (r1 + r2), X's dtype)  and  P = [Q1, Q2]  (n × (r1 + r2), fp32),

and the unpack returns X̃ = Z Pᵀ (``prac_decode_ref``), k = (n − r1)/r2: E[X̃] = X, so a linear
layer's weight gradient gYᵀX̃ is unbiased (Lemma 3), with variance (k − 1)·‖X − XQ1Q1ᵀ‖².

What differs from the eager codec, and why. A traced hook has no state that survives a step:
AOTAutograd copies the pack graph into the compiled forward (once per saved tensor) and cannot
lift a tensor the hook holds (a ``get_attr`` in the hook graph) as a graph input. So there is no
lazily refreshed Q1 (the eager codec's T1 = 5): Q1 is computed from X in every forward, by a
randomized range finder on X itself (Halko et al.; ``randomized_basis_ref``'s steps, with the
final rotation from the q × q Gram matrix of XB instead of the SVD of the tokens × q XB), i.e.
the paper's Alg. 1 with T1 = T2 = 1, and P is stored with Z (``q2="store"``). The random draws
(the range finder's Ω and Q2's S) use inductor's seeded RNG prims (``prims.inductor_random``:
the graph's own seeds, drawn from the global generator per call, so runs are reproducible from
``torch.manual_seed``); eagerly (the tests) they are ``torch.randn``. Cost per coded tensor:
about (2 + 2·niter + 2)·tokens·n·q multiply-adds plus two QRs of n × q, q = r1 + oversample, on
top of the projection itself: more than the linear layer that saved it. The eager codec spends
that once per T1 steps; PRAC pays off when tokens ≫ n and the step is GEMM-bound (prac.txt's
setting), not at llama-20m's 2048 tokens on a CPU (BENCHMARKS.md §7). ``sketch_rows`` reads every s-th row
only for the range finder (cheaper at large token counts; Z still projects every row).

Which saved tensors, read off the saved forward-graph node (torch >= 2.10), as prac.txt §5.1 and
``strategies/prac.py``: a tensor a ``mm``/``addmm``/``bmm`` reads as its activation operand (a
linear layer's input) takes r1 = r2 = ⌊``linear``·n⌋, any other float tensor (a norm's or an
activation's input) ⌊``other``·n⌋ (0: kept); SDPA's q, k, v, output and statistics are never
coded (the caller's rules keep them), nor is a tensor whose Z + P would not be smaller than it.
Extreme values: the range finder reads X / max|X| (the same directions; XᵀX cannot overflow),
with NaN and inf read as 0, so the basis stays orthonormal and the estimator unbiased (any Q1
is); a row of X holding NaN or inf decodes to NaN or inf (as Z's row), the rest as usual.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from slimact.codecs.prac_ref import complement_of_ref, prac_decode_ref

try:  # registers prims.inductor_seeds / inductor_lookup_seed / inductor_random
    import torch._inductor.inductor_prims  # noqa: F401

    _SEEDED = hasattr(torch.ops.prims, "inductor_random")
except ImportError:  # pragma: no cover - a torch without inductor
    _SEEDED = False

PRAC_TAG = "prac"  # the payload's last item: (z, p, dtype, "prac")
_VIEWS = ("view", "_unsafe_view", "reshape", "alias", "clone")
_ACTIVATION_ARG = {"mm": 0, "addmm": 1, "bmm": 0}  # where a matmul reads its activation operand

Draw = Callable[[tuple[int, ...], torch.device], torch.Tensor]


@dataclass(frozen=True)
class TracedPrac:
    """Rank fractions of n: ``linear`` for linear layers' inputs, ``other`` for other float
    saves (0: keep them); ``niter`` power iterations and ``oversample`` extra columns for the
    range finder, which reads every s-th row, s = tokens // ``sketch_rows`` (0: every row);
    tensors whose last dimension is below ``min_features`` are kept."""

    linear: float = 0.3
    other: float = 0.2
    niter: int = 1
    oversample: int = 8
    min_features: int = 8
    sketch_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("linear", "other"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 0.5:
                raise ValueError(
                    f"TracedPrac.{name} is r1 = r2 as a fraction of n and must be in [0, 0.5) "
                    f"(r1 + r2 < n), got {v!r}"
                )
        for name, low in (("niter", 0), ("oversample", 0), ("min_features", 2), ("sketch_rows", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"TracedPrac.{name} must be an int >= {low}, got {v!r}")

    def ranks(self, shape: tuple[int, ...], itemsize: int, linear: bool) -> tuple[int, int] | None:
        """(r1, r2) for a tensor of ``shape``, or None to keep it: too narrow, a rank of 0, a
        range finder with fewer rows than r1, or Z + P not smaller than the tensor."""
        n = shape[-1]
        tokens = math.prod(shape[:-1])
        r = math.floor((self.linear if linear else self.other) * n)
        if n < self.min_features or r < 1 or tokens < r + self.oversample:
            return None
        payload = tokens * 2 * r * itemsize + n * 2 * r * 4  # Z in X's dtype, P in fp32
        return (r, r) if payload < tokens * n * itemsize else None


def feeds_linear(node: torch.fx.Node | None, depth: int = 3) -> bool:
    """Does a matmul read ``node`` (through views) as its activation operand?"""
    if node is None or depth == 0:
        return False
    for user in node.users:
        name = getattr(user.target, "__name__", str(user.target)).split(".")[0]
        arg = _ACTIVATION_ARG.get(name)
        if arg is not None and len(user.args) > arg and user.args[arg] is node:
            return True
        if name in _VIEWS and feeds_linear(user, depth - 1):
            return True
    return False


def draw_normal(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """N(0, 1) fp32 draws that inductor lowers to its own seeded RNG (``torch.randn`` inside a
    pack hook reaches inductor after its random-op pass and fails to lower)."""
    if not _SEEDED:  # pragma: no cover
        return torch.randn(shape, device=device)
    prims = torch.ops.prims
    seed = prims.inductor_lookup_seed.default(prims.inductor_seeds.default(1, device), 0)
    return prims.inductor_random.default(list(shape), seed, "randn")


def principal_basis(xs: torch.Tensor, r1: int, niter: int, oversample: int, draw: Draw):
    """Top-r1 right singular directions of ``xs`` (T × n, fp32) as n × r1: B = orth(XᵀXΩ),
    ``niter`` steps B ← orth(XᵀXB), then Q1 = B·V with V the top-r1 eigenvectors of (XB)ᵀ(XB)."""
    n = xs.shape[1]
    q = min(r1 + oversample, n)
    b = torch.linalg.qr(xs.T @ (xs @ draw((n, q), xs.device))).Q
    for _ in range(niter):
        b = torch.linalg.qr(xs.T @ (xs @ b)).Q
    c = xs @ b
    _, v = torch.linalg.eigh(c.T @ c)  # ascending eigenvalues
    return b @ v[:, q - r1 :].flip(-1)


def complement_basis(q1: torch.Tensor, r2: int, draw: Draw) -> torch.Tensor:
    """Orthonormal n × r2 basis of (I − Q1Q1ᵀ)S, S ~ N(0, 1) (as ``random_complement_ref``)."""
    return complement_of_ref(q1, draw((q1.shape[0], r2), q1.device))


def encode_prac(
    x: torch.Tensor, r1: int, r2: int, config: TracedPrac, draw: Draw = draw_normal
) -> tuple:
    """Traceable pack: ``(z, p, dtype, "prac")``: z [..., r1 + r2] in x's dtype and p [n, r1 + r2]
    fp32, each stored as same-width integers (:func:`_bits`)."""
    n = x.shape[-1]
    with torch.autocast(x.device.type, enabled=False):  # the basis in fp32 under autocast too
        xf = x.reshape(-1, n).float()
        finite = torch.isfinite(xf)  # the basis from the finite values, scaled by their largest
        a = torch.where(finite, xf.abs(), 0.0).amax().clamp_min(1e-30)  # (same directions, so
        xs = torch.where(finite, xf / a, 0.0)  # XᵀX cannot overflow)
        step = max(1, xs.shape[0] // config.sketch_rows) if config.sketch_rows else 1
        q1 = principal_basis(xs[::step], r1, config.niter, config.oversample, draw)
        q2 = complement_basis(q1, r2, draw)
        k = (n - r1) / r2
        z = xf @ torch.cat((q1, q2 * k), dim=1)
    z = z.to(x.dtype).reshape(*x.shape[:-1], r1 + r2)
    return (_bits(z), _bits(torch.cat((q1, q2), dim=1)), x.dtype, PRAC_TAG)


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of its width (free): every traced codec's payload is
    non-float, which is how the meter tells a compiled graph's coded saves from kept ones."""
    return t.view(_INT_OF[t.element_size()])


def is_prac(payload: tuple) -> bool:
    return isinstance(payload[-1], str) and payload[-1] == PRAC_TAG


def decode_prac(payload: tuple) -> torch.Tensor:
    """Traceable unpack: X̃ = Z Pᵀ in the saved dtype (``prac_decode_ref``)."""
    z, p, dtype, _ = payload
    z, p = z.view(dtype), p.view(torch.float32)
    with torch.autocast(z.device.type, enabled=False):
        y = prac_decode_ref(z.reshape(-1, z.shape[-1]), p, dtype)
    return y.reshape(*z.shape[:-1], p.shape[0])
