"""The draws of stochastic rounding: a counter-based hash of ``(seed, element index)``.

``slimact.ops.quant`` rounds ``floor(v + u)`` with ``u ~ U[0, 1)`` when asked to round
stochastically (its docstring has the math). ``u`` must be the same in the plain-PyTorch ref,
its inductor-compiled CPU form and the Triton kernel, bit for bit, and a function of a seed
only, so that a run is reproducible and a resumed run draws what the uninterrupted one did.
A counter-based hash gives both:

    h = mix(mix(i_lo ^ s0) ^ s1 ^ i_hi)        u = (h >> 8) * 2^-24

with ``i`` the value's index in the flat order of the tensor (``i_lo``/``i_hi`` its 32-bit
words), ``(s0, s1)`` the seed's two 31-bit halves, and ``mix`` a xorshift-multiply round on 32
bits (``h ^= h >> 16; h *= c1; h ^= h >> 15; h *= c2; h ^= h >> 16``, after Wellons's
lowbias32, with both multipliers odd and below 2^31). Here it runs in int64 masked to 32 bits:
below 2^31, a multiplier times a 32-bit value never overflows int64, and the low 32 bits are
what the Triton kernel's wrapping uint32 arithmetic computes. ``u`` takes the top 24 bits, so
it is exact in fp32 and strictly below 1.

Trade-offs, against drawing ``u`` with ``torch.rand`` and passing it to the kernel: nothing is
drawn from a torch generator (global RNG streams, which dropout and the baseline twin replay,
do not move), the seed is a host integer (no sync, no state on the device), and no ``u`` tensor
is written and read (``torch.rand`` would add 8 bytes of memory traffic per value to a kernel
that reads 2 to 4 and writes 0.5 to 1). The price is the hash: about a dozen integer ops per
value, fused into the quantize pass (measured in BENCHMARKS.md, stochastic rounding). For a
fixed seed, ``i -> h`` is a bijection of 32-bit words, as a block cipher (Philox) is: draws
look independent across indices and seeds, which the tests check for the statistics that
matter here (uniform marginals, an unbiased rounding, uncorrelated neighbours and seeds).
"""

from __future__ import annotations

import torch

SEED_BITS = 62  # a seed is two 31-bit halves (Triton takes them as int32 arguments)
_M32 = 0xFFFFFFFF
_MIX = (0x7FEB352D, 0x5BD1E995)  # odd, below 2^31: h * c < 2^63 for h < 2^32


def seed_halves(seed: int) -> tuple[int, int]:
    """The two 31-bit halves ``(s0, s1)`` of ``seed`` (its low :data:`SEED_BITS` bits)."""
    return seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF


def seed_tensor(seed: int) -> torch.Tensor:
    """``seed`` as the 0-d int64 host tensor the refs take (a tensor, so a compiled ref is not
    specialized on its value; built on the host: no device involved)."""
    return torch.tensor(seed & ((1 << SEED_BITS) - 1), dtype=torch.int64)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """One xorshift-multiply round on int64 values in [0, 2^32) (the kernel's, in uint32)."""
    h = h ^ (h >> 16)
    h = (h * _MIX[0]) & _M32
    h = h ^ (h >> 15)
    h = (h * _MIX[1]) & _M32
    return h ^ (h >> 16)


def uniform_ref(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """fp32 draws in [0, 1) on a 2^-24 grid, one per int64 ``index`` (module docstring). A 0-d
    ``seed`` tensor may live on the host beside a device ``index`` (a scalar operand: no
    copy)."""
    s0, s1 = seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF
    h = _mix32((index & _M32) ^ s0)
    h = _mix32(h ^ s1 ^ (index >> 32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def draws(v: torch.Tensor, seed: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`uniform_ref`'s draws for the values ``v`` (laid out contiguously in the flat order
    of the input, any padding last), or None without a seed (round to nearest)."""
    if seed is None:
        return None
    index = torch.arange(v.numel(), dtype=torch.int64, device=v.device).view(v.shape)
    return uniform_ref(index, seed)


def uniform(shape: tuple[int, ...], seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The draws of a tensor of ``shape`` under ``seed``, in its flat order (what the
    quantizers add; the tests hand them to the traced codec to compare it with the ref)."""
    n = 1
    for s in shape:
        n *= s
    index = torch.arange(n, dtype=torch.int64, device=device).view(shape)
    return uniform_ref(index, seed_tensor(seed))
