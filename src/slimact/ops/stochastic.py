"""The draws of stochastic rounding: a counter-based hash of ``(seed, element index)``.

``slimact.ops.quant`` rounds ``floor(v + u)`` with ``u ~ U[0, 1)`` when asked to round
stochastically (its docstring has the math). ``u`` must be the same in the plain-PyTorch ref,
its inductor-compiled CPU form and the Triton kernel, bit for bit, and a function of a seed
only, so that a run is reproducible and a resumed run draws what the uninterrupted one did.
A counter-based hash gives both:

    k = key(seed)        h = mix((i + k) mod 2^32)        u = (h >> 8) * 2^-24

with ``i`` the value's index in the flat order of the tensor, ``key`` a 31-bit digest of the
seed taken on the host (splitmix64's finalizer: neighbouring seeds give unrelated keys), and
``mix`` one xorshift-multiply round on 32 bits (``h ^= h >> 16; h *= c1; h ^= h >> 15;
h *= c2; h ^= h >> 16``, Wellons's lowbias32 with the second multiplier below 2^31). Here it
runs in int64 masked to 32 bits: a multiplier below 2^31 times a 32-bit value never overflows
int64, and the low 32 bits are what the Triton kernel's wrapping uint32 arithmetic computes.
``u`` takes the top 24 bits, so it is exact in fp32 and strictly below 1.

Why this is enough: ``mix`` is a bijection of 32-bit words with full avalanche, so over the
seeds (``k`` uniform) every value's draw is uniform and the draws of one value in successive
encodes are independent; within an encode, neighbouring indices give unrelated draws. Two
encodes whose keys differ by ``d`` share draws shifted by ``d`` elements (value ``i`` of one,
value ``i + d`` of the other), never at the same element unless ``d = 0`` (probability 2^-31):
no value's rounding is tied to its own earlier rounding or to another tensor's rounding of the
same element. Indices wrap at 2^32 (values 4 Gi elements apart share a draw). The tests check
the statistics that matter here (uniform marginals, uncorrelated neighbours and seeds, an
unbiased rounding).

Trade-offs, against drawing ``u`` with ``torch.rand`` and passing it to the kernel: nothing is
drawn from a torch generator (global RNG streams, which dropout and the baseline twin replay,
do not move), the seed is a host integer (no sync, no state on the device), and no ``u`` tensor
is written and read (``torch.rand`` would add 8 bytes of memory traffic per value to a kernel
that reads 2 to 4 and writes 0.5 to 1). The price is the hash, about ten integer ops per value
fused into the quantize pass; on a CPU the int64 multiplies are what it costs (AVX2 has no
64-bit vector multiply), measured in BENCHMARKS.md (stochastic rounding).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_MIX = (0x7FEB352D, 0x5BD1E995)  # odd, below 2^31: h * c < 2^63 for h < 2^32


def seed_key(seed: int) -> int:
    """The 31-bit key of ``seed`` (any int >= 0): splitmix64's finalizer, on the host."""
    z = (seed + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 33


def key_tensor(seed: int) -> torch.Tensor:
    """``seed_key(seed)`` as the 0-d int64 host tensor the refs take (a tensor, so a compiled
    ref is not specialized on its value; built on the host: no device involved)."""
    return torch.tensor(seed_key(seed), dtype=torch.int64)


def uniform_ref(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """fp32 draws in [0, 1) on a 2^-24 grid, one per int64 ``index`` (module docstring). A 0-d
    ``key`` tensor may live on the host beside a device ``index`` (a scalar operand: no
    copy)."""
    h = (index + key) & _M32
    h = h ^ (h >> 16)
    h = (h * _MIX[0]) & _M32
    h = h ^ (h >> 15)
    h = (h * _MIX[1]) & _M32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def draws(v: torch.Tensor, key: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`uniform_ref`'s draws for the values ``v`` (laid out contiguously in the flat order
    of the input, any padding last), or None without a key (round to nearest)."""
    if key is None:
        return None
    index = torch.arange(v.numel(), dtype=torch.int64, device=v.device).view(v.shape)
    return uniform_ref(index, key)


def uniform(shape: tuple[int, ...], seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The draws of a tensor of ``shape`` under ``seed``, in its flat order (what the
    quantizers add; the tests hand them to the traced codec to compare it with the ref)."""
    n = 1
    for s in shape:
        n *= s
    index = torch.arange(n, dtype=torch.int64, device=device).view(shape)
    return uniform_ref(index, key_tensor(seed))
