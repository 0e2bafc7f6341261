"""Triton kernels of the inverted activations (``slimact.ops.inv_act``); needs ``triton``.

``_fwd_kernel`` computes y and the packed branch bit in one pass (BLOCK is a multiple of 8, so
each program writes whole bytes; bit ``i % 8`` of byte ``i // 8``); ``_bwd_kernel`` unpacks the
bit (or reads y's last mantissa bit, ``variant="lsb"``) and evaluates g(y, s) = f'(f⁻¹(y; s)) in
fp32, step for step as ``inv_act_approx.dinv_newton_ref`` / ``dinv_paper_ref`` do, then
dx = dy·g. Every element evaluates both Newton solvers and selects (no divergence in a block).

    x, y, dy, dx: (n,) contiguous, fp32 / bf16 / fp16;   packed: ((n + 7) // 8,) uint8

This module imports ``triton`` at import time and is imported by ``inv_act`` only on first use of
a Triton path, so ``TRITON_INTERPRET=1`` (kernels on CPU tensors, for tests) is read then.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimact.ops.inv_act_approx import BRANCH, KINDS, MODES, NEWTON_ITERS

BLOCK = 1024


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
def _dinv(y, s, KIND: tl.constexpr, MODE: tl.constexpr, T, FT_HI, FT_LO, K, ITERS: tl.constexpr):
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


def inv_act_fwd_triton(x: torch.Tensor, kind: str, variant: str = "bitmask"):
    """x: (*shape) -> (y (*shape), packed ((n + 7) // 8,) uint8, or None for 'lsb')."""
    x = x.contiguous()
    n = x.numel()
    y = torch.empty_like(x)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n:
        _fwd_kernel[(triton.cdiv(n, BLOCK),)](
            x,
            y,
            packed,
            n,
            BRANCH[kind].T,
            KIND=KINDS.index(kind),
            LSB=variant == "lsb",
            BITS=x.element_size() * 8,
            BLOCK=BLOCK,
        )
    return y, (None if variant == "lsb" else packed)


def inv_act_bwd_triton(dy, y, packed, kind: str, mode: str = "newton", variant: str = "bitmask"):
    """dy, y: (*shape), packed as the forward returned it -> dx: (*shape)."""
    dy = dy.contiguous()
    n = y.numel()
    dx = torch.empty_like(y)
    b = BRANCH[kind]
    if n:
        _bwd_kernel[(triton.cdiv(n, BLOCK),)](
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
            BLOCK=BLOCK,
        )
    return dx
