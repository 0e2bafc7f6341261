"""Triton kernels of ``slimact.ops.quant``: quantize+pack and unpack+dequantize, one program
per ``GROUPS`` groups (or per ``GROUPS * BLOCK`` values in channel-wise mode). Several groups per
program keep a program's tile near a few thousand values whatever the group size: one program per
group of 16 launches a warp group for 16 values and leaves the GPU's bandwidth unused.

``quant_kernel`` reads a group as ``[BLOCK/2, 2]`` pairs, so INT4 packing (even element in the low
nibble) is a row reduction; it zeroes non-finite values and ``keep`` columns, writes the group's
fp32 scale (and offset, asymmetric) and its count of non-finite values, then the biased codes;
a group holding non-finite values is marked (the sign bit of its scale, a smaller divisor, the
reserved codes: ``quant.py``'s docstring). With ``STOCH`` it rounds ``floor(v + u)``, ``u`` the
top 24 bits of ``ops.stochastic``'s hash of the element index plus the seed's key, in wrapping
uint32 arithmetic (the ref's int64 arithmetic masked to 32 bits gives the same values). It is launched
with ``enable_fp_fusion=False``: a fused ``x * inv + u`` (one rounding) can land on the other
side of an integer than the ref's two roundings. ``dequant_kernel`` is its inverse. ``quant.py`` launches them (``quantize_triton`` & co.) and
holds the ``*_ref`` twins they match bit for bit.

With ``EXACT_COLS`` it also writes the outlier codec's exact columns
(``codecs.outlier``: ``K`` column indices of the ``[N / C, C]`` view, their values ``[N / C,
K]``, and with ``HAS_FLAG`` which of them are outliers) over the decoded ones, in the same pass.

``triton`` is optional (``slimact[gpu]``): it is imported, and the kernels defined, on the first
call of :func:`kernels`, so ``TRITON_INTERPRET=1`` set by a test is read then.
"""

from __future__ import annotations

import functools


@functools.cache
def kernels():
    """(quant_kernel, dequant_kernel), defined on first use (see the module docstring)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["key", "NPART"])
    def quant_kernel(X, KEEP, INV, Q, S, OFF, NF, N, C, div, divm, key, ST, PART, NPART, SLOT,
                     BLOCK: tl.constexpr, GROUPS: tl.constexpr, BITS: tl.constexpr,
                     SYM: tl.constexpr, HAS_KEEP: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     STOCH: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
                     BIAS: tl.constexpr, STATS: tl.constexpr = False,
                     ROWS: tl.constexpr = False):  # fmt: skip
        # one program = GROUPS groups of BLOCK values (or GROUPS * BLOCK values in channel mode),
        # seen as [GROUPS, BLOCK/2, 2] pairs so INT4 packing is a reduction over the last axis
        gid = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # [G]
        rows = tl.arange(0, BLOCK // 2)
        cols = tl.arange(0, 2)
        offs = gid[:, None, None] * BLOCK + rows[None, :, None] * 2 + cols[None, None, :]
        mask = offs < N
        gmask = gid * BLOCK < N  # [G]
        xo = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        finite = (xo == xo) & (tl.abs(xo) != float("inf"))
        x = tl.where(finite, xo, 0.0)
        if HAS_KEEP:
            keep = tl.load(KEEP + offs % C, mask=mask, other=0)
            x = tl.where(keep != 0, x, 0.0)
        if PER_CHANNEL:
            sc = tl.load(S + offs % C, mask=mask, other=0.0)  # signed: the column's mark
            marked = sc.to(tl.int32, bitcast=True) < 0
            v = x * tl.load(INV + offs % C, mask=mask, other=0.0)
        else:
            nbad = tl.sum(tl.sum((mask & (finite == 0)).to(tl.int32), axis=2), axis=1)  # [G]
            tl.store(NF + gid, nbad, mask=gmask)
            gmarked = nbad > 0
            d = tl.where(gmarked, divm, div)
            if SYM:
                scale = tl.div_rn(tl.max(tl.max(tl.abs(x), axis=2), axis=1), d)
                off = tl.zeros_like(scale)
            else:
                mx = tl.max(tl.max(tl.where(mask, x, -float("inf")), axis=2), axis=1)
                mn = tl.min(tl.min(tl.where(mask, x, float("inf")), axis=2), axis=1)
                total = mx + mn
                span = mx - mn
                off = tl.where(tl.abs(total) == float("inf"), mx * 0.5 + mn * 0.5, total * 0.5)
                scale = tl.where(
                    tl.abs(span) == float("inf"),
                    tl.div_rn(mx, d) - tl.div_rn(mn, d),
                    tl.div_rn(span, d),
                )
                tl.store(OFF + gid, off, mask=gmask)
            tl.store(S + gid, tl.where(gmarked, -scale, scale), mask=gmask)
            if STATS:  # codecs.quant.scale_stats_ref: min/max of the magnitudes, 0 read as 1
                mag = tl.where(scale == 0, 1.0, scale)
                tl.atomic_min(ST + SLOT, tl.min(tl.where(gmask, mag, float("inf")), axis=0))
                tl.atomic_max(ST + SLOT + 1, tl.max(tl.where(gmask, mag, -float("inf")), axis=0))
                if not SYM:
                    omax = tl.max(tl.where(gmask, tl.abs(off), -float("inf")), axis=0)
                    tl.atomic_max(ST + SLOT + 2, omax)
                if ROWS:  # the max row norm: row_norm_kernel's partial maxima, by program 0
                    if tl.program_id(0) == 0:
                        best = tl.zeros([1024], dtype=tl.float32)
                        for p0 in range(0, NPART, 1024):
                            pi = p0 + tl.arange(0, 1024)
                            part = tl.load(PART + pi, mask=pi < NPART, other=0.0)
                            best = tl.maximum(best, part)
                        tl.store(ST, tl.max(best, axis=0))
            inv = tl.where(scale > 0, tl.div_rn(1.0, tl.maximum(scale, 1e-30)), 0.0)
            v = (x - off[:, None, None]) * inv[:, None, None]
            marked = gmarked[:, None, None]
        lo = tl.where(marked, LO + 2, LO).to(tl.float32)
        hi = tl.where(marked, HI - 1, HI).to(tl.float32)
        if STOCH:  # ops.stochastic.uniform_ref: one mixer round of the index plus the key
            h = offs.to(tl.uint32) + key.to(tl.uint32)
            h = h ^ (h >> 16)
            h = h * 0x7FEB352D
            h = h ^ (h >> 15)
            h = h * 0x5BD1E995
            h = h ^ (h >> 16)
            r = tl.floor(v + (h >> 8).to(tl.float32) * (1.0 / 16777216.0))
        else:
            r = tl.floor(v + 0.5)
        r = tl.minimum(tl.maximum(r, lo), hi)
        special = tl.where(xo > 0, (1 << BITS) - 1, tl.where(xo < 0, 1, 0))
        u = tl.where(finite, r.to(tl.int32) + BIAS, special)
        if PER_CHANNEL:  # the ref pads an odd count with a zero code (groups pad with zeros)
            u = tl.where(mask, u, 0)
        if BITS == 4:
            byte = tl.sum(u * tl.where(cols == 0, 1, 16)[None, None, :], axis=2)  # lo | hi << 4
            bidx = gid[:, None] * (BLOCK // 2) + rows[None, :]  # [G, BLOCK/2]
            tl.store(Q + bidx, byte.to(tl.uint8), mask=bidx * 2 < N)
        else:
            tl.store(Q + offs, u.to(tl.uint8), mask=mask)

    @triton.jit
    def dequant_kernel(Q, S, OFF, Y, N, C, ymax, IDX, FLAG, VAL, K,
                       BLOCK: tl.constexpr, GROUPS: tl.constexpr, BITS: tl.constexpr,
                       SYM: tl.constexpr, PER_CHANNEL: tl.constexpr,
                       BIAS: tl.constexpr, EXACT_COLS: tl.constexpr = False,
                       HAS_FLAG: tl.constexpr = False):  # fmt: skip
        gid = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # [G]
        rows = tl.arange(0, BLOCK // 2)
        cols = tl.arange(0, 2)
        offs = gid[:, None, None] * BLOCK + rows[None, :, None] * 2 + cols[None, None, :]
        mask = offs < N
        if BITS == 4:
            bidx = gid[:, None] * (BLOCK // 2) + rows[None, :]  # [G, BLOCK/2]
            b = tl.load(Q + bidx, mask=bidx * 2 < N, other=0).to(tl.int32)
            u = tl.where(cols[None, None, :] == 0, (b & 15)[:, :, None], (b >> 4)[:, :, None])
        else:
            u = tl.load(Q + offs, mask=mask, other=0).to(tl.int32)
        code = (u - BIAS).to(tl.float32)
        if PER_CHANNEL:
            sc = tl.load(S + offs % C, mask=mask, other=0.0)
            y = code * tl.abs(sc)
        else:
            gmask = gid * BLOCK < N
            sc = tl.load(S + gid, mask=gmask, other=0.0)[:, None, None]
            y = code * tl.abs(sc)
            if not SYM:
                y = y + tl.load(OFF + gid, mask=gmask, other=0.0)[:, None, None]
        y = tl.minimum(tl.maximum(y, -ymax), ymax)
        marked = sc.to(tl.int32, bitcast=True) < 0
        y = tl.where(marked & (u == 0), float("nan"), y)
        y = tl.where(marked & (u == 1), -float("inf"), y)
        y = tl.where(marked & (u == (1 << BITS) - 1), float("inf"), y)
        y = y.to(Y.dtype.element_ty)
        if EXACT_COLS:  # the outlier codec's exact columns of the [N / C, C] view
            col = offs % C
            for j in range(0, K):
                at = tl.load(IDX + j)
                if HAS_FLAG:  # an unflagged column decodes as coded: matched by no column
                    at = tl.where(tl.load(FLAG + j) != 0, at, -1)
                hit = mask & (col == at)
                val = tl.load(VAL + (offs // C) * K + j, mask=hit, other=0.0)
                y = tl.where(hit, val, y)
        tl.store(Y + offs, y, mask=mask)

    return quant_kernel, dequant_kernel


@functools.cache
def row_norm_kernel():
    """The row norms of a contiguous ``[R, C]`` tensor, as ``codecs.rows.row_stats_ref`` takes
    them (NaN/inf read as 0, fp32 sums of squares, a correctly rounded square root; summed in
    another order than torch's, so within a few ulps of it): every ``step``-th row's norm at
    ``ST[1 + row // step]``, each program's maximum at ``PART[program]`` (``quant_kernel``
    with ``ROWS`` reduces them into ``ST[0]``), and, from program 0, the initial values of the
    scale statistics ``quant_kernel`` gathers at ``ST[SLOT:]`` by atomic min/max. ``KEEP``
    (uint8 ``[C]``, with ``HAS_KEEP``): columns read as 0 where it is 0 (the outlier codec's
    exact channels); ``IDX`` (``K`` column indices, with ``K > 0``): those columns of every row
    copied to ``VAL`` (``[R, K]``, ``X``'s dtype: the outlier codec's exact values)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_norms(X, ST, PART, R, C, step, SLOT, KEEP, IDX, VAL, K, RB: tl.constexpr,
                  CB: tl.constexpr, SYM: tl.constexpr, HAS_KEEP: tl.constexpr,
                  GATHER: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        rows = pid * RB + tl.arange(0, RB)
        rmask = rows < R
        base = rows[:, None].to(tl.int64) * C
        acc = tl.zeros([RB], dtype=tl.float32)
        for c0 in range(0, C, CB):
            cols = c0 + tl.arange(0, CB)
            m = rmask[:, None] & (cols[None, :] < C)
            v = tl.load(X + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
            v = tl.where((v == v) & (tl.abs(v) != float("inf")), v, 0.0)
            if HAS_KEEP:
                keep = tl.load(KEEP + cols, mask=cols < C, other=0)
                v = tl.where(keep[None, :] != 0, v, 0.0)
            acc += tl.sum(v * v, axis=1)
        if GATHER:
            for j0 in range(0, K, CB):
                js = j0 + tl.arange(0, CB)
                jm = js < K
                idx = tl.load(IDX + js, mask=jm, other=0)
                m = rmask[:, None] & jm[None, :]
                val = tl.load(X + base + idx[None, :], mask=m, other=0.0)
                tl.store(VAL + rows[:, None].to(tl.int64) * K + js[None, :], val, mask=m)
        norm = tl.sqrt_rn(acc)
        tl.store(ST + 1 + rows // step, norm, mask=rmask & (rows % step == 0))
        tl.store(PART + pid, tl.max(tl.where(rmask, norm, 0.0), axis=0))
        if pid == 0:
            tl.store(ST + SLOT, float("inf"))
            tl.store(ST + SLOT + 1, -float("inf"))
            if not SYM:
                tl.store(ST + SLOT + 2, -float("inf"))

    return row_norms


@functools.cache
def channel_scale_kernel():
    """The channel-wise scales of a contiguous ``[R, C]`` tensor, as ``ops.quant.channel_scale``
    computes them (a program per ``CB`` columns, over every row): the signed scale (a column
    holding NaN/inf marked), its inverse for ``quant_kernel``'s ``PER_CHANNEL`` mode and the
    count of non-finite values, with ``row_norm_kernel``'s statistics completed: the scales'
    magnitude bounds at ``ST[SLOT:]`` (atomic min/max) and, by program 0, the maximum of the
    row norms' partial maxima at ``ST[0]``."""
    import triton
    import triton.language as tl

    @triton.jit
    def channel_scales(X, S, INV, NF, ST, PART, NPART, SLOT, R, C, div, divm,
                       RB: tl.constexpr, CB: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        cols = pid * CB + tl.arange(0, CB)
        cmask = cols < C
        amax = tl.zeros([CB], dtype=tl.float32)
        nbad = tl.zeros([CB], dtype=tl.int32)
        for r0 in range(0, R, RB):
            rows = r0 + tl.arange(0, RB)
            m = (rows[:, None] < R) & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * C + cols[None, :]
            v = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
            fin = (v == v) & (tl.abs(v) != float("inf"))
            amax = tl.maximum(amax, tl.max(tl.where(fin, tl.abs(v), 0.0), axis=0))
            nbad += tl.sum((m & (fin == 0)).to(tl.int32), axis=0)
        marked = nbad > 0
        scale = tl.div_rn(amax, tl.where(marked, divm, div))
        tl.store(S + cols, tl.where(marked, -scale, scale), mask=cmask)
        tl.store(INV + cols, tl.where(scale > 0, tl.div_rn(1.0, tl.maximum(scale, 1e-30)), 0.0),
                 mask=cmask)  # fmt: skip
        tl.store(NF + cols, nbad, mask=cmask)
        mag = tl.where(scale == 0, 1.0, scale)
        tl.atomic_min(ST + SLOT, tl.min(tl.where(cmask, mag, float("inf")), axis=0))
        tl.atomic_max(ST + SLOT + 1, tl.max(tl.where(cmask, mag, -float("inf")), axis=0))
        if pid == 0:
            best = tl.zeros([1024], dtype=tl.float32)
            for p0 in range(0, NPART, 1024):
                pi = p0 + tl.arange(0, 1024)
                best = tl.maximum(best, tl.load(PART + pi, mask=pi < NPART, other=0.0))
            tl.store(ST, tl.max(best, axis=0))

    return channel_scales


__all__ = ["channel_scale_kernel", "kernels", "row_norm_kernel"]
