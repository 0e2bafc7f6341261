"""Inverted activations (invact.txt): GELU / tanh-GELU / SiLU that save their *output* + 1 bit.

A pointwise ``y = f(x)`` normally saves ``x`` for ``dx = dy·f'(x)``, while the layer after it
(a Linear, or the ``*`` of SwiGLU) saves ``y`` anyway: two tensors of the same size live until
backward. Here the autograd Function saves ``y`` itself (the same storage the next op saves, so
the meter counts it once) plus ``s = [x < T]`` bit-packed 8 per uint8 (§2: bit ``i % 8`` of byte
``i // 8``), and backward computes ``dx = dy·f'(f⁻¹(y; s))`` (``slimact.ops.inv_act_approx``).
Net cost of the activation: n/8 bytes instead of n·sizeof(dtype), i.e. −97% (fp32) / −94% (bf16).

Variants (``variant=``):

* ``"bitmask"`` (default): y exact, mask in a separate uint8 tensor.
* ``"lsb"`` (§2.1 precision bit): s is written into y's least significant mantissa bit, so nothing
  extra is saved, but the forward output is off by up to 1 ulp (2⁻²³ relative in fp32, 2⁻⁷ in
  bf16) — every later layer sees the perturbed y.
* sign-bit (§2.1) is *not* offered: it stores ``f(x) − min f`` with the sign bit replaced by s,
  which is no longer the tensor the next layer consumes; the consumer must undo the bit trick
  (``(Y ^ S) + C``) inside its own forward and backward, i.e. a fused Act+Linear (or Act·Up)
  Function per consumer type. It would save the last n/8 bytes; the bitmask already gets 97%.

Kernels: ``_fwd_kernel`` computes y and the packed mask in one pass (BLOCK is a multiple of 8 so
each program writes whole bytes); ``_bwd_kernel`` unpacks the bit and evaluates g(y, s) in fp32.
Both are used for CUDA tensors when triton is importable (or ``backend="triton"``, which also runs
on CPU under ``TRITON_INTERPRET=1``); ``*_ref`` are the plain-PyTorch path used on CPU and in tests.

``torch.compile``: under dynamo the op goes through two ``torch.library`` custom ops,
``slimact::inv_act_fwd`` (x -> y, packed) and ``slimact::inv_act_bwd`` (dy, y, packed -> dx), tied
by ``register_autograd``. They are opaque to the compiler (the bit unpacking and the Newton
inversion's masked updates are data-dependent and would break the graph), so a compiled block
containing an inverted activation is one graph, and AOTAutograd saves exactly y + packed.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from slimact import sites
from slimact.ops.inv_act_approx import BRANCH, KINDS, MODES, NEWTON_ITERS, dinv_ref

VARIANTS = ("bitmask", "lsb")
BACKENDS = ("auto", "torch", "triton")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _check(x: torch.Tensor, kind: str, mode: str, variant: str, backend: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"inverted {kind} needs a floating-point tensor (float32, bfloat16, float16, float64), "
            f"got dtype {x.dtype}"
        )
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if variant == "lsb" and x.dtype == torch.float64:
        raise TypeError("variant='lsb' supports float32, bfloat16 and float16, got float64")


def pack_bits_ref(s: torch.Tensor) -> torch.Tensor:
    """Bool tensor -> uint8 of ceil(n/8) bytes; element i is bit i % 8 of byte i // 8."""
    flat = s.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, device=flat.device, dtype=torch.uint8)
    return (flat.view(-1, 8) << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()


def act_ref(x: torch.Tensor, kind: str) -> torch.Tensor:
    """torch's own forward (the exact reference)."""
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


def set_lsb_ref(y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    iv = y.view(_INT_VIEW[y.dtype])
    return ((iv & ~1) | s.to(iv.dtype)).view(y.dtype)


def get_lsb_ref(y: torch.Tensor) -> torch.Tensor:
    return (y.view(_INT_VIEW[y.dtype]) & 1).bool()


def inv_act_fwd_ref(x: torch.Tensor, kind: str, variant: str = "bitmask"):
    """(y, packed mask or None). y is torch's own f(x); for 'lsb' its last bit holds s."""
    y = act_ref(x, kind)
    s = (x if x.dtype == torch.float64 else x.float()) < BRANCH[
        kind
    ].T  # T not rounded to x's dtype
    if variant == "lsb":
        return set_lsb_ref(y, s), None
    return y, pack_bits_ref(s)


def inv_act_bwd_ref(dy, y, packed, kind: str, mode: str = "newton", variant: str = "bitmask"):
    s = get_lsb_ref(y) if variant == "lsb" else unpack_bits_ref(packed, y.numel()).view(y.shape)
    g = dinv_ref(y, s, kind, mode)
    return (dy.to(g.dtype) * g).to(dy.dtype)


# ----------------------------------------------------------------------------- Triton kernels
_KERNELS: dict = {}


def _build_kernels() -> None:
    """Define the Triton kernels on first use (so TRITON_INTERPRET is read then, not at import).

    They are bound as module globals so the jit functions can call each other by name.
    """
    global triton, tl, _f_q_df, _log_q, _dinv, _fwd_kernel, _bwd_kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _f_q_df(x, KIND: tl.constexpr):
        if KIND == 0:
            q = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            df = q + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        elif KIND == 1:
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            q = tl.sigmoid(2.0 * u)
            df = q + x * 2.0 * q * (1.0 - q) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        else:
            q = tl.sigmoid(x)
            df = q * (1.0 + x * (1.0 - q))
        return x * q, q, df

    @triton.jit
    def _log_q(x, q, KIND: tl.constexpr):
        if KIND == 0:
            r = tl.log(q)
        else:
            if KIND == 1:
                z = 1.5957691216057308 * (x + 0.044715 * x * x * x)
            else:
                z = x
            r = tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z)))
        return r

    @triton.jit
    def _dinv(
        y, s, KIND: tl.constexpr, MODE: tl.constexpr, T, FT_HI, FT_LO, K, ITERS: tl.constexpr
    ):
        # y: fp32 block, s: bool block. Mirrors inv_act_approx.dinv_newton_ref / dinv_paper_ref.
        t = tl.maximum((y - FT_HI) - FT_LO, 0.0)
        r = tl.sqrt(t)
        if MODE == 1:  # paper, Eqs. 5-8 (App. A.2; SiLU tables relabelled)
            if KIND == 2:
                left = (
                    0.217177007595768
                    - 0.507684370508263 * r
                    + 0.079631397669175 * t
                    + 0.357494204859375 * t * t
                ) * (1.0 - y) + y
                c = (
                    0.002696163985044
                    * (-5.770613302664509 - t)
                    * (-5.770613302664509 - t)
                    * (-5.770613302664509 - t)
                )
                sig = 1.0 + (
                    -1.310856402130980 + 0.848589647031652 * r - 0.162990512595109 * t
                ) * tl.exp(c)
                right = sig * (1.0 - y) + y
            else:
                t = tl.maximum(y + 0.16997120747990369, 0.0)
                r = tl.sqrt(t)
                yl = tl.minimum(y, 0.0)
                inner = (
                    tl.abs(1.2947087 * y * y + tl.abs(1.98055565 * y + 0.22730362) - 0.038978495)
                    + 1.3295193
                )
                left = (
                    1.6311011311381
                    * tl.sqrt(tl.maximum(y + 0.16997246666667, 0.0))
                    * (2.0 * yl - 0.06261728 * tl.sqrt(-yl))
                    * inner
                )
                c = (
                    0.032146736769376
                    * (-2.119885089843949 - t)
                    * (-2.119885089843949 - t)
                    * (-2.119885089843949 - t)
                )
                right = 1.0 + (
                    -1.383717971214795 + 1.558420184350027 * r + 0.044045748018110 * t
                ) * tl.exp(c)
            out = tl.where(s, left, right)
        else:  # newton
            sign = tl.where(s, -1.0, 1.0)
            x = T + sign * K * r
            x = tl.where((~s) & (y > 0.0), tl.maximum(x, y), x)
            for _ in tl.static_range(ITERS):
                fx, q, g = _f_q_df(x, KIND)
                Fx = sign * tl.sqrt(tl.maximum((fx - FT_HI) - FT_LO, 0.0))
                ratio = tl.where(tl.abs(g) > 1e-6, 2.0 * Fx / g, K)
                x = x - (Fx - sign * r) * ratio
                x = tl.where(s, tl.minimum(x, T), tl.maximum(x, T))
            L = tl.log(tl.maximum(-y, 1.1754943508222875e-38))
            if KIND == 2:
                xt = L - tl.log(tl.maximum(-L, 1.0))
            else:
                xt = -tl.sqrt(tl.maximum(-2.0 * L - 1.8378770664093453, 1.0))
            xt = tl.minimum(xt, T)
            for _ in tl.static_range(ITERS):
                fx, q, g = _f_q_df(xt, KIND)
                resid = tl.log(-xt) + _log_q(xt, q, KIND) - L
                step = resid * fx / g
                ok = (step == step) & (tl.abs(step) < float("inf"))
                step = tl.where(ok, step, -0.5)
                xt = tl.minimum(xt - step, T)
            x = tl.where(s & (y > 0.5 * (FT_HI + FT_LO)), xt, x)
            out = _f_q_df(x, KIND)[2]
        out = tl.where(s & (y >= 0.0), 0.0, out)
        out = tl.where(y == float("inf"), 1.0, out)
        return tl.where(y != y, y, out)

    @triton.jit
    def _fwd_kernel(
        x_ptr,
        y_ptr,
        m_ptr,
        n,
        T,
        KIND: tl.constexpr,
        LSB: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _f_q_df(x, KIND)[0]
        s = x < T
        yo = y.to(y_ptr.dtype.element_ty)
        if LSB:  # §2.1 precision bit: s replaces the last mantissa bit
            if BITS == 32:
                yi = yo.to(tl.int32, bitcast=True)
                yo = ((yi & -2) | s.to(tl.int32)).to(tl.float32, bitcast=True)
            else:
                yi = yo.to(tl.int16, bitcast=True)
                yo = ((yi & -2) | s.to(tl.int16)).to(y_ptr.dtype.element_ty, bitcast=True)
        tl.store(y_ptr + offs, yo, mask=mask)
        if not LSB:
            bits = tl.reshape((s & mask).to(tl.int32), (BLOCK // 8, 8))
            byte = tl.sum(bits << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8)
            boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
            tl.store(m_ptr + boffs, byte, mask=boffs < (n + 7) // 8)

    @triton.jit
    def _bwd_kernel(
        dy_ptr,
        y_ptr,
        m_ptr,
        dx_ptr,
        n,
        T,
        FT_HI,
        FT_LO,
        K,
        KIND: tl.constexpr,
        MODE: tl.constexpr,
        LSB: tl.constexpr,
        BITS: tl.constexpr,
        ITERS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        yraw = tl.load(y_ptr + offs, mask=mask, other=0.0)
        if LSB:
            if BITS == 32:
                s = (yraw.to(tl.int32, bitcast=True) & 1) != 0
            else:
                s = (yraw.to(tl.int16, bitcast=True) & 1) != 0
        else:
            byte = tl.load(m_ptr + offs // 8, mask=mask, other=0).to(tl.int32)
            s = ((byte >> (offs % 8)) & 1) != 0
        y = yraw.to(tl.float32)
        g = _dinv(y, s, KIND, MODE, T, FT_HI, FT_LO, K, ITERS)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, (dy * g).to(dx_ptr.dtype.element_ty), mask=mask)

    _KERNELS.update(fwd=_fwd_kernel, bwd=_bwd_kernel)


_BLOCK = 1024


def inv_act_fwd_triton(x: torch.Tensor, kind: str, variant: str = "bitmask"):
    if not _KERNELS:
        _build_kernels()
    fwd = _KERNELS["fwd"]
    x = x.contiguous()
    n = x.numel()
    y = torch.empty_like(x)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n:
        fwd[(triton.cdiv(n, _BLOCK),)](
            x,
            y,
            packed,
            n,
            BRANCH[kind].T,
            KIND=KINDS.index(kind),
            LSB=variant == "lsb",
            BITS=x.element_size() * 8,
            BLOCK=_BLOCK,
        )
    return y, (None if variant == "lsb" else packed)


def inv_act_bwd_triton(dy, y, packed, kind: str, mode: str = "newton", variant: str = "bitmask"):
    if not _KERNELS:
        _build_kernels()
    bwd = _KERNELS["bwd"]
    dy = dy.contiguous()
    n = y.numel()
    dx = torch.empty_like(y)
    b = BRANCH[kind]
    if n:
        bwd[(triton.cdiv(n, _BLOCK),)](
            dy,
            y,
            y if packed is None else packed,
            dx,
            n,
            b.T,
            b.fT_hi,
            b.fT_lo,
            b.K,
            KIND=KINDS.index(kind),
            MODE=MODES.index(mode),
            LSB=variant == "lsb",
            BITS=y.element_size() * 8,
            ITERS=NEWTON_ITERS,
            BLOCK=_BLOCK,
        )
    return dx


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend == "torch" or x.dtype == torch.float64:
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' but triton is not installed (pip install triton)")
        return True
    return x.is_cuda and triton_available()


# ----------------------------------------------------------------------------- autograd
class InvActFunction(torch.autograd.Function):
    """Saves y (the output itself) + the packed branch bit; backward: dy·f'(f⁻¹(y; s))."""

    @staticmethod
    def forward(ctx, x, kind, mode, variant, backend):
        xc = x.contiguous()
        if _use_triton(xc, backend):
            y, packed = inv_act_fwd_triton(xc, kind, variant)
        else:
            y, packed = inv_act_fwd_ref(xc, kind, variant)
        ctx.cfg = (kind, mode, variant, backend)
        if packed is None:
            ctx.save_for_backward(y)
        else:
            ctx.save_for_backward(y, packed)
        return y

    @staticmethod
    def backward(ctx, dy):
        # dy, y: (*shape) -> dx: (*shape); packed: (ceil(numel/8),) uint8
        kind, mode, variant, backend = ctx.cfg
        saved = ctx.saved_tensors
        y, packed = saved[0], (saved[1] if len(saved) > 1 else None)
        dy = dy.contiguous()
        if _use_triton(y, backend):
            dx = inv_act_bwd_triton(dy, y, packed, kind, mode, variant)
        else:
            dx = inv_act_bwd_ref(dy, y, packed, kind, mode, variant)
        return dx, None, None, None, None


# ----------------------------------------------------------------------------- torch.library
@torch.library.custom_op("slimact::inv_act_fwd", mutates_args=())
def _inv_act_fwd_op(
    x: torch.Tensor, kind: str, mode: str, variant: str, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    # x: (*shape) -> y: (*shape), packed: (ceil(numel/8),) uint8 ((0,) for 'lsb'); mode is
    # only read by the backward (setup_context keeps it)
    xc = x.contiguous()
    if _use_triton(xc, backend):
        y, packed = inv_act_fwd_triton(xc, kind, variant)
    else:
        y, packed = inv_act_fwd_ref(xc, kind, variant)
    return y, (xc.new_empty(0, dtype=torch.uint8) if packed is None else packed)


@_inv_act_fwd_op.register_fake
def _(x, kind, mode, variant, backend):
    n = 0 if variant == "lsb" else (x.numel() + 7) // 8
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        n, dtype=torch.uint8
    )


@torch.library.custom_op("slimact::inv_act_bwd", mutates_args=())
def _inv_act_bwd_op(
    dy: torch.Tensor,
    y: torch.Tensor,
    packed: torch.Tensor,
    kind: str,
    mode: str,
    variant: str,
    backend: str,
) -> torch.Tensor:
    # dy, y: (*shape) -> dx: (*shape)
    packed_or_none = None if variant == "lsb" else packed
    dy = dy.contiguous()
    if _use_triton(y, backend):
        return inv_act_bwd_triton(dy, y, packed_or_none, kind, mode, variant)
    return inv_act_bwd_ref(dy, y, packed_or_none, kind, mode, variant)


@_inv_act_bwd_op.register_fake
def _(dy, y, packed, kind, mode, variant, backend):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _op_setup_context(ctx, inputs, output):
    _, kind, mode, variant, backend = inputs
    ctx.cfg = (kind, mode, variant, backend)
    ctx.save_for_backward(*output)


def _op_backward(ctx, dy, dpacked):
    kind, mode, variant, backend = ctx.cfg
    y, packed = ctx.saved_tensors
    return _inv_act_bwd_op(dy, y, packed, kind, mode, variant, backend), None, None, None, None


_inv_act_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def inv_act_op(
    x: torch.Tensor,
    kind: str,
    mode: str = "newton",
    variant: str = "bitmask",
    backend: str = "auto",
) -> torch.Tensor:
    """The custom-op path (what ``inv_act`` runs under ``torch.compile``); eager-callable too."""
    return _inv_act_fwd_op(x, kind, mode, variant, backend)[0]


def inv_act(
    x: torch.Tensor,
    kind: str,
    *,
    mode: str = "newton",
    variant: str = "bitmask",
    backend: str = "auto",
) -> torch.Tensor:
    """Inverted ``kind`` in {'gelu', 'gelu_tanh', 'silu'}: same forward, saves output + 1 bit."""
    _check(x, kind, mode, variant, backend)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return act_ref(x, kind)
    if torch.compiler.is_compiling():
        return inv_act_op(x, kind, mode, variant, backend)
    with sites.role(f"inv_{kind}"):
        return InvActFunction.apply(x, kind, mode, variant, backend)


def inv_gelu(
    x: torch.Tensor,
    approximate: str = "none",
    *,
    mode: str = "newton",
    variant: str = "bitmask",
    backend: str = "auto",
) -> torch.Tensor:
    """Drop-in for ``F.gelu(x, approximate=...)`` that saves y + 1 bit/element for backward."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    kind = "gelu_tanh" if approximate == "tanh" else "gelu"
    return inv_act(x, kind, mode=mode, variant=variant, backend=backend)


def inv_silu(
    x: torch.Tensor, *, mode: str = "newton", variant: str = "bitmask", backend: str = "auto"
) -> torch.Tensor:
    """Drop-in for ``F.silu(x)`` that saves y + 1 bit/element for backward."""
    return inv_act(x, "silu", mode=mode, variant=variant, backend=backend)
