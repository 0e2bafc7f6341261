"""Bit-packed masks: dropout masks and any bool or two-valued {0, c} tensor at 1 bit per element.

Autograd keeps dropout masks as ``bool`` (CUDA, one byte per element) or as the float noise
``{0, 1/(1-p)}`` that multiplied the input (CPU, four bytes). Eight mask bits pack into one byte,
element ``8j + i`` in bit ``i`` of byte ``j``; a tensor of ``n`` values takes exactly ``ceil(n/8)``
bytes (plus one value ``c`` for non-bool tensors) and decodes bit-exactly (adacc.txt §3.2:
"compress the original byte format to bit format without accuracy loss"): ``c`` is selected
where a bit is set, never multiplied by it, so an additive attention mask ``{0, -inf}`` decodes
to itself, where ``0 * -inf`` would be NaN. Non-bool tensors are
accepted only when every value is 0 or one single ``c`` (checked, one pass); anything else is
rejected with a ``ValueError``, never rounded.
Bytes that already hold packed bits (InvAct's uint8 masks) fail that check and must stay as they
are; the ``int4`` strategy leaves them alone for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimact.codecs.base import Codec, CodecConfig, Packed, register_codec

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_bits(x: torch.Tensor) -> torch.Tensor:
    """bool/{0,1} tensor -> uint8 [ceil(n/8)], element 8j+i in bit i of byte j."""
    b = x.reshape(-1).to(torch.uint8)
    b = F.pad(b, (0, -b.numel() % 8)).view(-1, 8)
    return (b << _SHIFTS.to(b.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n/8)] -> bool [n]."""
    bits = (packed.view(-1, 1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(-1)[:n].bool()


def is_binary(x: torch.Tensor) -> bool:
    """True for bool tensors and for tensors whose values are all 0 or 1."""
    if x.dtype == torch.bool:
        return True
    if x.is_complex():
        return False
    return x.numel() == 0 or bool(((x == 0) | (x == 1)).all())


def two_valued(x: torch.Tensor) -> torch.Tensor | None:
    """``c`` (a 1-element tensor of x's dtype) if every value of ``x`` is 0 or ``c``, else None."""
    if x.dtype == torch.bool or x.numel() == 0:
        return torch.ones(1, dtype=x.dtype, device=x.device)
    if x.is_complex():
        return None
    hi, lo = x.max(), x.min()
    c = torch.where(hi != 0, hi, lo).reshape(1)
    if not bool(((x == 0) | (x == c)).all()):
        return None
    return c if bool(c != 0) else torch.ones(1, dtype=x.dtype, device=x.device)


@dataclass(frozen=True)
class BitsConfig(CodecConfig):
    """1 bit per element for bool or {0,1} tensors (exact)."""


class BitsCodec(Codec):
    config: BitsConfig
    codes_float64 = True  # lossless for any dtype

    def encode(self, x: torch.Tensor) -> Packed:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec 'bits' needs a tensor, got {type(x).__name__}")
        c = two_valued(x)
        if c is None:
            raise ValueError(
                f"codec 'bits' stores bool or two-valued {{0, c}} tensors; this {x.dtype} tensor "
                f"of shape {tuple(x.shape)} holds other values"
            )
        tensors = {"bits": pack_bits(x != 0)}
        if x.dtype != torch.bool:
            tensors["value"] = c
        return Packed(tensors, tuple(x.shape), x.dtype, x.device, {"numel": x.numel()})

    def decode(self, packed: Packed) -> torch.Tensor:
        y = unpack_bits(packed.tensors["bits"], packed.meta["numel"])
        if "value" in packed.tensors:  # selected, not multiplied: 0 * inf would be NaN
            value = packed.tensors["value"].reshape(())
            y = torch.where(y, value, torch.zeros((), dtype=packed.dtype, device=y.device))
        return y.view(packed.shape)


register_codec("bits", BitsConfig(), BitsCodec)
