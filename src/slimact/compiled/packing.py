"""Byte packing for the traced codecs: bool masks 8 to a byte, INT4/INT6 codes from contiguous
slices of a row (``slimact.compiled.codec``'s docstring says why slices, not neighbours)."""

from __future__ import annotations

import torch


def pack_bits(x: torch.Tensor) -> torch.Tensor:
    """Bool ``x`` -> uint8 ``[numel / 8]``: bit i of byte j is value ``i * numel / 8 + j``
    (eight contiguous slices of the flat tensor, so every step is a vectorized pointwise op)."""
    planes = x.reshape(8, -1).to(torch.uint8)
    out = planes[0]
    for i in range(1, 8):
        out = out | (planes[i] << i)
    return out


def unpack_bits(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bits`."""
    planes = [((packed >> i) & 1) for i in range(8)]
    return torch.cat(planes).to(torch.bool).reshape(shape)


def pack_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Biased codes ``u`` (uint8, [..., D]) -> bytes, per row in contiguous slices (module
    docstring): INT4 ``[..., D/2]`` (code j low, j + D/2 high), INT6 ``[..., 3D/4]``."""
    if bits == 8:
        return u
    if bits == 4:
        lo, hi = u.chunk(2, dim=-1)
        return lo | (hi << 4)
    a, b, c, d = u.chunk(4, dim=-1)  # INT6: a, b, c's 6 bits, each with 2 of d's on top
    return torch.cat((a | (d << 6), b | ((d >> 2) << 6), c | ((d >> 4) << 6)), dim=-1)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes -> biased codes ``[..., D]``."""
    if bits == 8:
        return codes
    if bits == 4:
        return torch.cat((codes & 15, codes >> 4), dim=-1)
    p, q, r = codes.chunk(3, dim=-1)
    d = (p >> 6) | ((q >> 6) << 2) | ((r >> 6) << 4)
    return torch.cat((p & 63, q & 63, r & 63, d), dim=-1)
