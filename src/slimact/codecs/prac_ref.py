"""PRAC's plain-PyTorch math: rank rules, the subspace bases and the encode/decode references.

The only implementation (two small GEMMs, an SVD and a QR), used by ``codecs/prac.py``'s codec,
the tests and the PRAC studies (BENCHMARKS.md); the module docstring of ``codecs/prac.py`` has the
math (Z = [XQ1, k·XQ2], X̃ = Z·[Q1, Q2]ᵀ, k = (n − r1)/r2).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

SVD_METHODS = ("exact", "randomized")
Q2_MODES = ("regenerate", "store")


def _is_rank(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def resolve_rank(r: int | float, n: int) -> int:
    """A rank given as a fraction of n (float) or absolute (int) -> absolute: ⌊r·n⌋ or r."""
    return int(math.floor(r * n)) if isinstance(r, float) else int(r)


def check_ranks(r1: int, r2: int, n: int, where: str = "") -> None:
    """Absolute ranks must satisfy r1, r2 >= 0, 1 <= r1 + r2 <= n - 1."""
    if r1 < 0 or r2 < 0 or r1 + r2 < 1 or r1 + r2 >= n:
        at = f" at {where}" if where else ""
        raise ValueError(
            f"PRAC ranks r1={r1}, r2={r2}{at} are invalid for feature size n={n}: "
            f"need r1 >= 0, r2 >= 0 and 1 <= r1 + r2 <= {n - 1} (r1 + r2 < n)"
        )


def validate_rank_pair(r1: Any, r2: Any, what: str) -> None:
    """Config-time check of a (r1, r2) pair: floats are fractions of n, ints are absolute."""
    for name, v in (("r1", r1), ("r2", r2)):
        if not _is_rank(v):
            raise ValueError(f"{what} {name} must be an int or a float, got {v!r}")
        if v < 0:
            raise ValueError(f"{what} {name} must be >= 0, got {v}")
        if isinstance(v, float) and not v < 1:
            raise ValueError(f"{what} {name}={v} is a fraction of n and must be in [0, 1)")
    if r1 == 0 and r2 == 0:
        raise ValueError(f"{what}: r1 and r2 are both 0; at least one must be > 0")
    if isinstance(r1, float) and isinstance(r2, float) and r1 + r2 >= 1:
        raise ValueError(f"{what}: r1 + r2 = {r1 + r2} must be < 1 (fractions of n, r1 + r2 < n)")


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch references (the only implementation: two small GEMMs, an SVD and a QR).


def principal_basis_ref(x: torch.Tensor, r1: int) -> torch.Tensor:
    """Top-r1 right singular vectors of x (T × n) as an n × r1 fp32 matrix (exact SVD)."""
    x = x.float()
    full = x.shape[0] < r1  # fewer rows than r1: complete the basis with null-space directions
    _, _, vh = torch.linalg.svd(x, full_matrices=full)
    return vh[:r1].T.contiguous()


def randomized_basis_ref(
    x: torch.Tensor, r1: int, gen: torch.Generator, niter: int = 2, oversample: int = 8
) -> torch.Tensor:
    """Approximate top-r1 right singular vectors by a randomized range finder (Halko et al.).

    B = orth(XᵀXΩ), Ω ~ N(0, 1) (n × q, q = r1 + oversample), refined by ``niter`` power steps
    B ← orth(XᵀXB); then the exact SVD of the thin X B (T × q) rotates B onto the top-r1
    directions. Cost O(T·n·q) instead of O(T·n·min(T, n)).
    """
    x = x.float()
    t, n = x.shape
    q = min(r1 + oversample, n, t)
    if q < r1:
        return principal_basis_ref(x, r1)
    omega = to_device(torch.randn(n, q, generator=gen), x.device)
    basis, _ = torch.linalg.qr(x.T @ (x @ omega))  # n × q, spans the top right-singular space
    for _ in range(niter):
        basis, _ = torch.linalg.qr(x.T @ (x @ basis))
    _, _, vh = torch.linalg.svd(x @ basis, full_matrices=False)  # (T × q) -> q × q
    return (basis @ vh[:r1].T).contiguous()


def random_complement_ref(
    q1: torch.Tensor, n: int, r2: int, gen: torch.Generator, batch: tuple[int, ...] = ()
) -> torch.Tensor:
    """Orthonormal basis (n × r2) of (I − Q1Q1ᵀ)S, S ~ N(0, 1): uniform in Q1's complement.

    ``batch`` draws that many independent bases at once, shape (*batch, n, r2).
    """
    return complement_of_ref(q1, to_device(torch.randn(*batch, n, r2, generator=gen), q1.device))


def complement_of_ref(q1: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of (I − Q1Q1ᵀ)S for given draws S (..., n, r2)."""
    for _ in range(2):  # project out Q1 twice ("twice is enough" for numerical orthogonality)
        s = s - q1 @ (q1.T @ s)
        s, _ = torch.linalg.qr(s)
    return s.contiguous()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host draw (``t``, freshly made: nothing writes it again) on ``device``, without waiting
    for the device: a blocking host-to-device copy synchronizes the stream first."""
    return t.to(device, non_blocking=True)


def _draw(seed: int, n: int, r2: int, device: torch.device) -> torch.Tensor:
    return to_device(torch.randn(n, r2, generator=torch.Generator().manual_seed(seed)), device)


def complement_factors_ref(
    q1: torch.Tensor, r2: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, R) of the seeded complement basis: S = N(0, 1)(seed), M = Q1ᵀS, S − Q1M = Q2R (QR).

    (n × r1) -> M (r1 × r2), R (r2 × r2, upper triangular); Q2 itself is ``complement_from_seed_ref``.
    """
    s = _draw(seed, q1.shape[0], r2, q1.device)
    m = q1.T @ s
    r = torch.linalg.qr(s - q1 @ m, mode="r").R  # Q itself is never formed here
    return m.contiguous(), r.contiguous()


def complement_from_seed_ref(
    q1: torch.Tensor, m: torch.Tensor, r: torch.Tensor, seed: int
) -> torch.Tensor:
    """Q2 = (S − Q1M)R⁻¹ (n × r2): the Q factor of the seeded S's projection, rebuilt on demand."""
    s = _draw(seed, q1.shape[0], r.shape[0], q1.device)
    return torch.linalg.solve_triangular(r, s - q1 @ m, upper=True, left=False)


def prac_encode_ref(x2d: torch.Tensor, p: torch.Tensor, r1: int, k: float) -> torch.Tensor:
    """Z = [XQ1, k·XQ2] = X P diag(1, k) in fp32, returned in x's dtype.  (T × n) -> (T × r)."""
    z = x2d.float() @ p
    if z.shape[1] > r1:
        z[:, r1:] *= k
    return z.to(x2d.dtype)


def prac_decode_ref(z: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """X̃ = Z Pᵀ.  (T × r) @ (r × n) -> (T × n), in ``dtype``."""
    return (z.float() @ p.T).to(dtype)


def prac_reconstruct_ref(x: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor) -> torch.Tensor:
    """X̃ = XQ1Q1ᵀ + kXQ2Q2ᵀ, k = (n − r1)/r2, straight from the formula (fp32)."""
    x = x.float()
    n, r1, r2 = x.shape[-1], q1.shape[1], q2.shape[1]
    out = x @ q1 @ q1.T
    if r2:
        out = out + (n - r1) / r2 * (x @ q2 @ q2.T)
    return out


# ----------------------------------------------------------------------------------------------


def site_seed(seed: int, key: str) -> int:
    """A per-site seed: the config seed mixed with a stable hash of the site/group key."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)
