"""Quantize+pack and unpack+dequantize for saved activations (adacc.txt §3.2, Eqs. 2-3).

A tensor is read as a flat array in memory order and cut into groups of ``group_size`` values
(the last group may be short). Each group gets an fp32 scale ``S`` (and, asymmetric, an fp32
offset ``O``) and every value becomes a ``bits``-wide integer code::

    symmetric   S = max|x| / div              q = clip(floor(x / S + 1/2), -2^(b-1), 2^(b-1)-1)
    asymmetric  O = (max x + min x) / 2,  S = (max x - min x) / div,  q = clip(floor((x-O)/S + 1/2))
    decode      x^ = q * S (+ O)

adacc.txt uses ``div = 8`` (symmetric) and ``div = 16`` (asymmetric) for INT4: the positive
extreme then maps to +8 / +8 and is clipped to 7, an error of a full step ``S`` on that value.
The default here is ``div = 2^(b-1)-1`` (7) and ``2^b-1`` (15), which keeps every value within
``S/2``; ``paper_scale=True`` restores the paper's divisors. Codes are stored biased (q + 2^(b-1))
as unsigned bytes; INT4 packs two codes per byte, the even element in the low nibble, so a tensor
of ``n`` values takes exactly ``ceil(n/2)`` bytes plus 4 bytes per group for ``S`` (8 with ``O``).

*Channel-wise* mode (Q/K/V in adacc.txt) uses one symmetric scale per column of an ``[R, C]`` view
(the max over all rows), so it needs no transpose: the scale is broadcast along rows.

Non-finite values are stored exactly, in band, at no extra cost: they never reach a scale (they
count as 0 there) and are counted per group (``nonfinite``). A group (or channel) holding any is
*marked*: its stored scale has its sign bit set (scales are otherwise >= +0), its finite values
use a divisor one step (symmetric) or two steps (asymmetric) smaller, ``2^(b-1)-2`` / ``2^b-4``
(6 / 12 for INT4, so within ``|x - x^| <= |S|/2`` still), which frees three codes: biased code 0
is NaN, 1 is -inf and ``2^b-1`` is +inf. Unmarked groups are coded exactly as before, so the
payload has a fixed size whatever the data, and nothing is read on the host to build it.
Magnitudes up to float32's max are safe too: an asymmetric group whose ``max - min`` (or
``max + min``) overflows takes its scale (offset) from the halves, and decoded values are clamped
to the output dtype's finite range, so a finite input never decodes to ±inf.
``keep_cols`` zeroes whole columns before quantization (the outlier channels of
``slimact.codecs.outlier``), fused into the same pass.

*Stochastic rounding* (``rounding="stochastic"``) replaces the ``+ 1/2`` by a uniform draw:
``q = floor(v + u)``, ``u ~ U[0, 1)``, so ``q`` is ``floor(v)`` with probability ``1 - frac(v)`` and
``floor(v) + 1`` otherwise: ``E[q] = v`` and ``E[x^] = x`` for every value inside the code range
(unbiased), at ``|x - x^| < S`` (one step, against half a step for round-to-nearest). Every
scaled value stays inside the range: symmetric groups already span ``[-div, div]``; asymmetric
ones take the divisor ``2^b - 2`` (14 for INT4: ``(x - O) / S`` in ``[-7, 7]``; the nearest
mode's 15 puts the maximum at 7.5, which rounds up to the missing code 8 half the time); marked
groups keep theirs. ``paper_scale`` divisors put the group maximum on the clipped code 8 by
design: that one value per group stays biased, as in nearest mode. The fp32 rounding of
``v + u`` adds a bias of at most half an ulp of ``2^(b-1)``: 2^-21 of a step (INT4), 2^-17 (INT8).

The draws are a counter-based hash of ``(seed, flat element index)`` (``ops.stochastic``), so a
seed fixes every draw and the ref, the compiled CPU path and the Triton kernel produce the same
codes bit for bit; nothing is drawn from a torch generator and no draw is stored. The caller
chooses the seed (``slimact.codecs.base``: a site's name and its count of encodes).

Every kernel has a ``*_ref`` plain-PyTorch twin producing bit-identical codes and scales. Triton
runs on CUDA (``backend="auto"``) or anywhere with ``backend="triton"`` (on CPU that needs
``TRITON_INTERPRET=1``, which is how the tests run it); on CPU ``"auto"`` runs the refs compiled
by inductor (``ops.compiled_ref``: a few fused loops instead of ~20 eager passes per tensor; the
tests check it equals the eager ref), ``backend="ref"`` the eager refs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimact.ops import compiled_ref, device_path
from slimact.ops.quant_triton import kernels
from slimact.ops.stochastic import draws as _draws
from slimact.ops.stochastic import key_tensor, seed_key

BACKENDS = ("auto", "ref", "triton")
ROUNDING = ("nearest", "stochastic")
_TINY = 1e-30
_CHANNEL_BLOCK = 1024
_TILE = 4096  # values per Triton program: GROUPS = _TILE // group size


def _groups_per_program(block: int) -> int:
    return max(1, _TILE // block)


@dataclass
class Quantized:
    """Packed codes plus what ``dequantize`` needs. ``channels > 0`` marks channel-wise mode."""

    codes: torch.Tensor  # uint8: ceil(n/2) bytes (4 bits) or n bytes (8 bits)
    scale: torch.Tensor  # fp32 [groups] or [channels]
    offset: torch.Tensor | None  # fp32 [groups] (asymmetric) or None
    nonfinite: torch.Tensor  # int32 count of non-finite inputs per group / per channel
    numel: int
    bits: int
    group_size: int
    channels: int = 0

    def tensors(self) -> list[torch.Tensor]:
        out = [self.codes, self.scale]
        return out + ([self.offset] if self.offset is not None else [])


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")


def _check_group(group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 2, got {group_size!r}")


def _check_float(x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"quantization needs a floating-point tensor, got dtype {x.dtype}")


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDING:
        raise ValueError(f"rounding must be one of {ROUNDING}, got {rounding!r}")


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def divisor(
    bits: int, symmetric: bool, paper_scale: bool = False, stochastic: bool = False
) -> float:
    """The ``div`` of the module docstring: 7/15 (INT4, default), 8/16 (INT4, paper); asymmetric
    stochastic rounding (not paper): 14, so the maximum's code stays in range."""
    levels = 1 << bits
    if symmetric:
        return float(levels // 2 if paper_scale else levels // 2 - 1)
    if paper_scale:
        return float(levels)
    return float(levels - 2 if stochastic else levels - 1)


def _limits(bits: int) -> tuple[int, int, int]:
    half = 1 << (bits - 1)
    return -half, half - 1, half  # lo, hi, bias


def marked_divisor(bits: int, symmetric: bool) -> float:
    """The divisor of a group or channel that holds non-finite values (module docstring): its
    finite codes stay within biased ``[2, 2^b - 2]``, leaving 0, 1 and ``2^b - 1`` free."""
    return float((1 << (bits - 1)) - 2 if symmetric else (1 << bits) - 4)


def reserved_codes(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The biased code of each non-finite value of ``x``: NaN 0, -inf 1, +inf ``2^b - 1``."""
    return torch.where(x > 0, (1 << bits) - 1, torch.where(x < 0, 1, 0))


def _codes(v, marked, bad, x, bits, u=None):
    """Rounded, clamped, biased uint8 codes of the scaled values ``v`` (to nearest, or
    ``floor(v + u)`` given draws ``u``); in marked groups the finite codes keep clear of the
    reserved ones, and ``bad`` values take theirs."""
    lo, hi, bias = _limits(bits)
    lo_t = torch.where(marked, float(lo + 2), float(lo))
    hi_t = torch.where(marked, float(hi - 1), float(hi))
    r = torch.floor(v + 0.5) if u is None else torch.floor(v + u)
    r = torch.minimum(torch.maximum(r, lo_t), hi_t) + bias
    return torch.where(bad, reserved_codes(x, bits).to(r.dtype), r).to(torch.uint8)


def _decoded(code, u, scale, bits, dtype):
    """Values of biased codes ``u`` (``code`` = u - bias, already multiplied out and offset by
    the caller) in ``dtype``: clamped to its finite range, the reserved codes of marked groups
    (sign bit of ``scale`` set) restored to NaN / -inf / +inf."""
    big = torch.finfo(dtype).max
    y = code.clamp(-big, big)
    marked = torch.signbit(scale)
    nan = torch.full((), float("nan"), dtype=y.dtype, device=y.device)
    special = torch.where(u == 0, nan, torch.where(u == 1, -float("inf"), float("inf")))
    is_special = marked & ((u == 0) | (u == 1) | (u == (1 << bits) - 1))
    return torch.where(is_special, special, y)


def _pack(u: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """u: uint8 biased codes (length >= n) -> packed bytes (exactly ceil(n/2) for 4 bits; one
    byte per code for 5-8 bits: the traced codec's INT6 reference, ``slimact.compiled.codec``)."""
    if bits > 4:
        return u[:n].contiguous()
    if u.numel() % 2:  # an odd group size times an odd group count (per-token rows)
        u = F.pad(u, (0, 1))
    pairs = u.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4))[: (n + 1) // 2].contiguous()


def _unpack(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    if bits > 4:
        return codes[:n]
    return torch.stack((codes & 15, codes >> 4), dim=1).view(-1)[:n]


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "ref":
        return False
    if backend == "auto":
        return device_path.takes_cuda_path(x) and triton_available()
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package, which is not importable")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1")
    return True


use_triton = _use_triton  # whether quantize/dequantize of ``x`` run the Triton kernels


def _runner(backend: str):
    """Off Triton, how the refs run: ``"auto"`` compiled where it pays (``compiled_ref.run``:
    CPU tensors of at least ``MIN_NUMEL`` values), ``"ref"`` eagerly."""
    return compiled_ref.run if backend == "auto" else compiled_ref.eager


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- references


def quantize_ref(
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = True,
    paper_scale: bool = False,
    keep_cols: torch.Tensor | None = None,
    rounding: str = "nearest",
    seed: int = 0,
) -> Quantized:
    """Per-group quantize+pack in plain PyTorch (``keep_cols``: bool [C], False -> zeroed;
    ``seed``: the draws of ``rounding="stochastic"``, see the module docstring)."""
    _check_rounding(rounding)
    _check_seed(seed)
    st = key_tensor(seed) if rounding == "stochastic" else None
    return _quantize(compiled_ref.eager, x, bits, group_size, symmetric, paper_scale, keep_cols,
                     st)  # fmt: skip


def _quantize(run, x, bits, group_size, symmetric, paper_scale, keep_cols, key) -> Quantized:
    """The codes by ``run`` (``compiled_ref.run``: compiled on CPU; ``.eager``: the ref), then
    packed eagerly. ``key``: the seed's ``ops.stochastic.key_tensor`` (stochastic rounding) or
    None (nearest)."""
    u, scale, offset, nonfinite = run(
        quantize_codes_ref, x.reshape(-1), keep_cols, key, bits=bits, group_size=group_size,
        symmetric=symmetric, paper_scale=paper_scale,
    )  # fmt: skip
    n = x.numel()
    return Quantized(_pack(u, n, bits), scale, offset, nonfinite, n, bits, group_size)


def quantize_codes_ref(
    x: torch.Tensor,
    keep_cols: torch.Tensor | None,
    key: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    paper_scale: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The unpacked biased codes (one uint8 per value, padded to whole groups), scale, offset,
    non-finite counts: what the CPU path compiles (``ops.compiled_ref``); ``key`` (a seed's 0-d
    int64 ``ops.stochastic.key_tensor``) rounds stochastically with its draws. Packing neighbours
    into one byte is a strided access that inductor does not vectorize, so it stays an eager
    op after the compiled call (the counts use :func:`count_true`; the timings: BENCHMARKS.md)."""
    n, gs = x.numel(), group_size
    groups = -(-n // gs)
    xo = x.reshape(-1).float()
    finite = torch.isfinite(xo)
    xf = torch.where(finite, xo, 0.0)
    pad = groups * gs - n
    if keep_cols is not None and keep_cols.numel() % gs == 0:
        # rows of whole groups, [rows, C / gs, gs]: the column mask broadcasts over rows, and
        # every op below keeps that shape (compiled, its inner loop is one vectorized group)
        shape = (-1, keep_cols.numel() // gs, gs)
        xp = xf.view(shape).masked_fill(~keep_cols.view(shape[1:]), 0.0)
        bad, xo = ~finite.view(shape), xo.view(shape)
    else:
        if keep_cols is not None:
            xf = xf.view(-1, keep_cols.numel()).masked_fill(~keep_cols, 0.0).view(-1)
        # no pad, no copy: compiled, a pad of symbolic size turns every load into index math
        xp = (F.pad(xf, (0, pad)) if pad else xf).view(groups, gs)
        bad = (F.pad(~finite, (0, pad)) if pad else ~finite).view(groups, gs)
        xo = (F.pad(xo, (0, pad)) if pad else xo).view(groups, gs)
    nonfinite = count_true(bad, -1)
    marked = nonfinite > 0
    stochastic = key is not None
    div = torch.where(
        marked, marked_divisor(bits, symmetric), divisor(bits, symmetric, paper_scale, stochastic)
    )
    if symmetric:
        scale, offset = xp.abs().amax(-1) / div, None
        v = xp * _inverse(scale)[..., None]
    else:
        if pad:
            valid = F.pad(torch.ones(n, dtype=torch.bool, device=x.device), (0, pad)).view(
                groups, gs
            )
            mx = xp.masked_fill(~valid, -float("inf")).amax(-1)
            mn = xp.masked_fill(~valid, float("inf")).amin(-1)
        else:
            mx, mn = xp.amax(-1), xp.amin(-1)
        total, span = mx + mn, mx - mn  # either overflows only for |x| near float32's max
        offset = torch.where(torch.isinf(total), mx * 0.5 + mn * 0.5, total * 0.5)
        scale = torch.where(torch.isinf(span), mx / div - mn / div, span / div)
        v = (xp - offset[..., None]) * _inverse(scale)[..., None]
        offset = offset.reshape(-1)
    draws = _draws(v, key)
    u = _codes(v, marked[..., None], bad, xo, bits, draws).reshape(-1)
    scale = torch.where(marked, -scale, scale)  # the mark: the sign bit (also of a zero scale)
    return u, scale.reshape(-1), offset, nonfinite.reshape(-1)


def count_true(mask: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 count of True along ``dim``, summed in floating point: exact (float32 holds every
    integer up to 2**24, float64 up to 2**53), and compiled it is a vectorized float reduction,
    where inductor runs an integer sum per small group lane by lane."""
    acc = torch.float32 if mask.shape[dim] <= 2**24 else torch.float64
    ones = torch.ones((), dtype=acc, device=mask.device)
    return torch.where(mask, ones, 0.0).sum(dim).to(torch.int32)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1/scale of unsigned scales (0 for 0), the way the kernels compute it. Divisions here are
    by tensors, never by Python scalars: CUDA divides a tensor by a scalar as a multiplication by
    its reciprocal, which can be one ulp off the kernels' ``div_rn``."""
    return torch.where(scale > 0, 1.0 / scale.clamp_min(_TINY), 0.0)


def dequantize_ref(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack+dequantize (group or channel mode) -> flat tensor of ``q.numel`` values."""
    return _dequantize(compiled_ref.eager, q, dtype)


def _dequantize(run, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """Unpacked eagerly, then the values by ``run`` (as :func:`_quantize`)."""
    return run(
        dequantize_codes_ref, _unpack(q.codes, q.numel, q.bits), q.scale, q.offset,
        bits=q.bits, group_size=q.group_size, channels=q.channels, dtype=dtype,
    )  # fmt: skip


def dequantize_codes_ref(
    u: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    channels: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Unpacked biased codes -> values: what the CPU path compiles (the unpacking, a strided
    interleave, stays eager: see :func:`quantize_codes_ref`). ``u`` holds exactly n codes."""
    n = u.numel()
    code = u.float() - _limits(bits)[2]
    if channels:
        u2 = u.view(-1, channels)
        y = code.view(-1, channels) * scale.abs()
        return _decoded(y, u2, scale, bits, dtype).view(-1).to(dtype)
    groups, gs = scale.numel(), group_size
    pad = groups * gs - n
    cp = F.pad(code, (0, pad)).view(groups, gs)
    up = F.pad(u, (0, pad)).view(groups, gs)
    y = cp * scale.abs()[:, None]
    if offset is not None:
        y = y + offset[:, None]
    return _decoded(y, up, scale[:, None], bits, dtype).view(-1)[:n].to(dtype)


def channel_scale(x2d: torch.Tensor, bits: int = 4, paper_scale: bool = False):
    """Per-column symmetric scales of an [R, C] view (signed: a column holding non-finite
    values is marked, see the module docstring) and the per-column non-finite counts
    (branch-free, so inductor compiles it whole: the finite mask is fused into the reduction)."""
    finite = torch.isfinite(x2d)
    if x2d.numel():
        amax = torch.where(finite, x2d, 0).abs().amax(0).float()
    else:
        amax = x2d.new_zeros(x2d.shape[1]).float()
    counts = count_true(~finite, 0)
    marked = counts > 0
    div = torch.where(marked, marked_divisor(bits, True), divisor(bits, True, paper_scale))
    scale = amax / div
    return torch.where(marked, -scale, scale), counts


def quantize_channelwise_ref(
    x2d: torch.Tensor,
    bits: int = 4,
    paper_scale: bool = False,
    rounding: str = "nearest",
    seed: int = 0,
) -> Quantized:
    """Channel-wise symmetric quantize+pack of an [R, C] tensor in plain PyTorch."""
    _check_rounding(rounding)
    _check_seed(seed)
    st = key_tensor(seed) if rounding == "stochastic" else None
    return _quantize_channelwise(compiled_ref.eager, x2d, bits, paper_scale, st)


def _quantize_channelwise(run, x2d, bits: int, paper_scale: bool, key) -> Quantized:
    u, scale, counts = run(
        quantize_channelwise_codes_ref, x2d, key, bits=bits, paper_scale=paper_scale
    )
    n, c = x2d.numel(), x2d.shape[1]
    return Quantized(_pack(u, n, bits), scale, None, counts, n, bits, 0, channels=c)


def quantize_channelwise_codes_ref(
    x2d: torch.Tensor, key: torch.Tensor | None = None, *, bits: int, paper_scale: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked biased codes, scale, counts: what the CPU path compiles (``key``: as
    :func:`quantize_codes_ref`'s)."""
    n = x2d.numel()
    scale, counts = channel_scale(x2d, bits, paper_scale)
    xo = x2d.float()
    finite = torch.isfinite(xo)
    v = torch.where(finite, xo, 0.0) * _inverse(scale.abs())
    u = _codes(v, torch.signbit(scale), ~finite, xo, bits, _draws(v, key)).view(-1)
    u = F.pad(u, (0, n % 2))
    return u, scale, counts


# ----------------------------------------------------------------------------- Triton launchers
# (the kernels: slimact.ops.quant_triton)


def quantize_triton(
    x: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = True,
    paper_scale: bool = False,
    keep_cols: torch.Tensor | None = None,
    rounding: str = "nearest",
    seed: int = 0,
) -> Quantized:
    """Triton twin of :func:`quantize_ref` (same codes, scales and counts; the same draws)."""
    quant_kernel, _ = kernels()
    stochastic = rounding == "stochastic"
    key = seed_key(seed)
    x = x.contiguous().view(-1)
    n, gs = x.numel(), group_size
    groups = -(-n // gs)
    lo, hi, bias = _limits(bits)
    dev = x.device
    codes = torch.empty((n + 1) // 2 if bits == 4 else n, dtype=torch.uint8, device=dev)
    scale = torch.empty(groups, dtype=torch.float32, device=dev)
    offset = None if symmetric else torch.empty(groups, dtype=torch.float32, device=dev)
    nonfinite = torch.empty(groups, dtype=torch.int32, device=dev)
    keep = keep_cols.to(torch.uint8) if keep_cols is not None else scale
    c = keep_cols.numel() if keep_cols is not None else 1
    if groups:
        per = _groups_per_program(gs)
        quant_kernel[(-(-groups // per),)](
            x, keep, scale, codes, scale, offset if offset is not None else scale, nonfinite,
            n, c, divisor(bits, symmetric, paper_scale, stochastic),
            marked_divisor(bits, symmetric), key, scale, scale, 0, 0, BLOCK=gs, GROUPS=per, BITS=bits, SYM=symmetric,
            HAS_KEEP=keep_cols is not None, PER_CHANNEL=False, STOCH=stochastic, LO=lo, HI=hi,
            BIAS=bias, enable_fp_fusion=False,
        )  # fmt: skip
    return Quantized(codes, scale, offset, nonfinite, n, bits, gs)


def quantize_channelwise_triton(
    x2d: torch.Tensor,
    bits: int = 4,
    paper_scale: bool = False,
    rounding: str = "nearest",
    seed: int = 0,
) -> Quantized:
    """Triton twin of :func:`quantize_channelwise_ref` (scales from the same torch reduction)."""
    quant_kernel, _ = kernels()
    key = seed_key(seed)
    n, c = x2d.numel(), x2d.shape[1]
    lo, hi, bias = _limits(bits)
    scale, counts = channel_scale(x2d, bits, paper_scale)
    inv = _inverse(scale.abs())
    x = x2d.contiguous().view(-1)
    codes = torch.empty((n + 1) // 2 if bits == 4 else n, dtype=torch.uint8, device=x.device)
    if n:
        per = _groups_per_program(_CHANNEL_BLOCK)
        quant_kernel[(-(-n // (_CHANNEL_BLOCK * per)),)](
            x, inv, inv, codes, scale, inv, counts, n, c, 1.0, 1.0, key, inv, inv, 0, 0,
            BLOCK=_CHANNEL_BLOCK, GROUPS=per, BITS=bits, SYM=True, HAS_KEEP=False, PER_CHANNEL=True,
            STOCH=rounding == "stochastic", LO=lo, HI=hi, BIAS=bias, enable_fp_fusion=False,
        )  # fmt: skip
    return Quantized(codes, scale, None, counts, n, bits, 0, channels=c)


def dequantize_triton(
    q: Quantized, dtype: torch.dtype = torch.float32, exact_cols: tuple | None = None
) -> torch.Tensor:
    """Triton twin of :func:`dequantize_ref`; ``exact_cols``: (channels, indices int32 [k],
    flags bool [k] or None, values [n / channels, k]) written over those columns."""
    _, dequant_kernel = kernels()
    n = q.numel
    y = torch.empty(n, dtype=dtype, device=q.codes.device)
    if n == 0:
        return y
    block = q.group_size or _CHANNEL_BLOCK
    offset = q.offset if q.offset is not None else q.scale
    ymax = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    per = _groups_per_program(block)
    cols, idx, flag, val, k = max(q.channels, 1), q.scale, q.scale, q.scale, 0
    if exact_cols is not None:
        cols, idx, flag, val = exact_cols
        k, flag = idx.numel(), q.scale if flag is None else flag.view(torch.uint8)
    dequant_kernel[(-(-n // (block * per)),)](
        q.codes, q.scale, offset, y, n, cols, ymax, idx, flag, val, k, BLOCK=block, GROUPS=per,
        BITS=q.bits, SYM=q.offset is None, PER_CHANNEL=q.channels > 0, BIAS=_limits(q.bits)[2],
        EXACT_COLS=k > 0, HAS_FLAG=flag is not q.scale,
    )  # fmt: skip
    return y


# ----------------------------------------------------------------------------- functional API


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int = 128,
    symmetric: bool = True,
    paper_scale: bool = False,
    keep_cols: torch.Tensor | None = None,
    rounding: str = "nearest",
    seed: int = 0,
    backend: str = "auto",
) -> Quantized:
    """Per-group quantize+pack of ``x`` in memory order (see module docstring); ``rounding``
    ``"nearest"`` or ``"stochastic"`` (its draws a function of ``seed``)."""
    _check_float(x)
    _check_bits(bits)
    _check_group(group_size)
    _check_rounding(rounding)
    _check_seed(seed)
    if keep_cols is not None and (x.dim() == 0 or keep_cols.numel() != x.shape[-1]):
        raise ValueError(
            f"keep_cols must have one entry per last-dim channel ({x.shape[-1] if x.dim() else 0})"
            f", got {keep_cols.numel()}"
        )
    if _use_triton(x, backend):
        return quantize_triton(x.contiguous(), bits, group_size, symmetric, paper_scale, keep_cols,
                               rounding, seed)  # fmt: skip
    st = key_tensor(seed) if rounding == "stochastic" else None
    return _quantize(_runner(backend), x.contiguous(), bits, group_size, symmetric, paper_scale,
                     keep_cols, st)  # fmt: skip


def quantize_channelwise(
    x: torch.Tensor,
    *,
    bits: int = 4,
    paper_scale: bool = False,
    rounding: str = "nearest",
    seed: int = 0,
    backend: str = "auto",
) -> Quantized:
    """Channel-wise symmetric quantize+pack: one scale per index of the last dimension."""
    _check_float(x)
    _check_bits(bits)
    _check_rounding(rounding)
    _check_seed(seed)
    if x.dim() == 0:
        x = x.reshape(1)
    x2d = x.contiguous().view(-1, x.shape[-1]) if x.shape[-1] else x.reshape(0, 1)
    if _use_triton(x, backend):
        return quantize_channelwise_triton(x2d, bits, paper_scale, rounding, seed)
    st = key_tensor(seed) if rounding == "stochastic" else None
    return _quantize_channelwise(_runner(backend), x2d, bits, paper_scale, st)


def dequantize(
    q: Quantized, *, dtype: torch.dtype = torch.float32, backend: str = "auto"
) -> torch.Tensor:
    """Unpack+dequantize -> flat tensor of ``q.numel`` values in ``dtype``."""
    if _use_triton(q.codes, backend):
        return dequantize_triton(q, dtype)
    return _dequantize(_runner(backend), q, dtype)
