"""The plain-PyTorch references of the inverted activations (``slimact.ops.inv_act``): what the
forward keeps beside y, and the backward from it.

The side channel, per variant: ``bitmask`` packs s = [x < T] 8 per uint8 (bit ``i % 8`` of byte
``i // 8``: :func:`pack_bits_ref` / :func:`unpack_bits_ref`); ``lsb`` writes s into y's last
mantissa bit (:func:`set_lsb_ref` / :func:`get_lsb_ref`); ``near-branch`` (bf16 / fp16) stores
one byte per element, the exact x for the 254 values nearest T (:func:`near_code_ref` /
:func:`near_decode_ref`). :func:`inv_act_fwd_ref` / :func:`inv_act_bwd_ref` are the reference
every other path (Triton, inductor, the traced backward) is tested against;
:func:`inv_act_bwd_dense` is the backward in the pointwise form inductor compiles
(``ops.compiled_ref``). g = f'(f⁻¹(y; s)) itself comes from ``ops.inv_act_approx`` (the
Newton reference) and ``ops.inv_act_poly`` (its piecewise-polynomial fit, the compiled path's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimact.ops.inv_act_approx import BRANCH, KINDS, act_ref, dinv_ref, f_q_df
from slimact.ops.inv_act_poly import dinv_poly

HALF = (torch.bfloat16, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# 16-bit pattern of T rounded to each half dtype, as a signed int (the near-branch code's origin)
_T_BITS = {
    (k, dt): int(torch.tensor(BRANCH[k].T, dtype=dt).view(torch.int16))
    for k in KINDS
    for dt in HALF
}
NEAR_HALF_WIDTH = 126  # codes 2..255 <-> bit offsets -126..127 from T's pattern


def pack_bits_ref(s: torch.Tensor) -> torch.Tensor:
    """Bool tensor -> uint8 of ceil(n/8) bytes; element i is bit i % 8 of byte i // 8. Written
    as 8 strided slices OR-ed together: pointwise over bytes, so inductor makes it one loop."""
    flat = s.reshape(-1).to(torch.int32)
    rows = F.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)  # (ceil(n/8), 8)
    out = rows[:, 0]
    for k in range(1, 8):
        out = out | (rows[:, k] << k)
    return out.to(torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def set_lsb_ref(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    iv = y.view(_INT_VIEW[y.dtype])
    return ((iv & ~1) | s.to(iv.dtype)).view(y.dtype)


def get_lsb_ref(y: torch.Tensor) -> torch.Tensor:
    return (y.view(_INT_VIEW[y.dtype]) & 1).bool()


def near_code_ref(x: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
    """x (*shape) bf16/fp16, s = [x < T] -> uint8 (*shape): 2 + 126 + (bits(x) − bits(T)) for
    the 254 values nearest T (same sign, so the bit offset is monotone in |x|), else s."""
    k = x.view(torch.int16).to(torch.int32) - _T_BITS[(kind, x.dtype)]
    near = (k >= -NEAR_HALF_WIDTH) & (k <= NEAR_HALF_WIDTH + 1)
    return torch.where(near, k + NEAR_HALF_WIDTH + 2, s.to(torch.int32)).to(torch.uint8)


def near_decode_ref(code: torch.Tensor, kind: str, dtype: torch.dtype):
    """uint8 code -> (s, near, x): x is exact where ``near`` (garbage elsewhere)."""
    c = code.to(torch.int32)
    bits = c - (NEAR_HALF_WIDTH + 2) + _T_BITS[(kind, dtype)]
    x = bits.to(torch.int16).view(dtype)
    near = c >= 2
    return torch.where(near, x.float() < BRANCH[kind].T, c == 1), near, x


def fwd_side_ref(x: torch.Tensor, y: torch.Tensor, kind: str, variant: str) -> torch.Tensor:
    """What the forward keeps beside y = f(x): the packed bits, the near-branch code, or (lsb)
    y with s in its last bit. x, y: (*shape); T compared in x's precision, not rounded to it."""
    s = (x if x.dtype == torch.float64 else x.float()) < BRANCH[kind].T
    if variant == "lsb":
        return set_lsb_ref(y, s)
    if variant == "near-branch":
        return near_code_ref(x, s, kind).reshape(-1)  # (n,)
    return pack_bits_ref(s)  # (ceil(n/8),)


def inv_act_fwd_ref(x: torch.Tensor, kind: str, variant: str = "bitmask"):
    """(y, side or None). y is torch's own f(x); for 'lsb' its last bit holds s."""
    y = act_ref(x, kind)
    side = fwd_side_ref(x, y, kind, variant)
    return (side, None) if variant == "lsb" else (y, side)


def _branch(y, side, kind: str, variant: str):
    """(s, near, x): the branch bit of every element; for 'near-branch' also where x is stored
    and its exact value (near and x are None otherwise)."""
    if variant == "near-branch":
        return near_decode_ref(side.view(y.shape), kind, y.dtype)
    s = get_lsb_ref(y) if variant == "lsb" else unpack_bits_ref(side, y.numel()).view(y.shape)
    return s, None, None


def _dx(dy, g, near, x, kind: str) -> torch.Tensor:
    if near is not None:
        g = torch.where(near, f_q_df(x.float(), kind)[2], g)  # torch's own f'(x), in fp32
    return (dy.to(g.dtype) * g).to(dy.dtype)


def inv_act_bwd_ref(dy, y, side, kind: str, mode: str = "newton", variant: str = "bitmask"):
    """dy, y: (*shape), side as the forward returned it -> dx (*shape)."""
    s, near, x = _branch(y, side, kind, variant)
    return _dx(dy, dinv_ref(y, s, kind, mode), near, x, kind)


def inv_act_bwd_dense(dyr, yr, side, *, kind: str, mode: str, variant: str, coeffs=None):
    """:func:`inv_act_bwd_ref` in pointwise form, what inductor compiles (``compiled_ref``):
    dyr, yr: (rows, w), zero-padded; side: bitmask words (rows,) of w bits (w = 8: the uint8
    bytes; w = 32: the same bytes viewed as int32, little-endian, so row j holds elements
    32j .. 32j + 31 and a row fills two AVX-512 vectors), the near-branch code (rows, 8) or None.
    Row j's bits unpack by a broadcast, not a gather; mode 'newton' evaluates g from the
    piecewise polynomials ``coeffs`` (``inv_act_poly.poly_floats(kind)``) instead of solving."""
    if variant == "bitmask":
        shifts = torch.arange(yr.shape[-1], device=yr.device, dtype=torch.int32)
        s, near, x = ((side.view(-1, 1).to(torch.int32) >> shifts) & 1).bool(), None, None
    else:
        s, near, x = _branch(yr, side, kind, variant)
    g = dinv_ref(yr, s, kind, mode) if mode == "paper" else dinv_poly(yr, s, kind, coeffs)
    return _dx(dyr, g, near, x, kind)


__all__ = [
    "HALF",
    "NEAR_HALF_WIDTH",
    "fwd_side_ref",
    "get_lsb_ref",
    "inv_act_bwd_dense",
    "inv_act_bwd_ref",
    "inv_act_fwd_ref",
    "near_code_ref",
    "near_decode_ref",
    "pack_bits_ref",
    "set_lsb_ref",
    "unpack_bits_ref",
]
