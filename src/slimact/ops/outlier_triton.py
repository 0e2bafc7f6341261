"""The outlier codec's deferred encode on the Triton path: three launches.

``codecs.outlier``'s deferred encode picks its site's *capacity* ``k`` of channels (columns of
the ``[R, C]`` view) of largest abs-sum Z-score, stores them exactly (flagged where their score
exceeds the threshold) and codes the rest, flagged channels zeroed, in INT4/INT8 per group;
its verdict counts the outliers and checks the rows (measured without the flagged channels)
and the scales. Eagerly that is about forty small kernels. Here:

1. ``column_kernel``: the channels' abs sums (a program per block of columns, over every row,
   so each sum has one order: the same every call); the last program to finish (an atomic
   ticket, reset by that program for the next call) turns them into Z-scores as
   ``codecs.outlier._z_scores`` does, counts the outliers, picks the ``k`` largest scores
   (ties: the lower channel first) and writes their indices in ascending order, their flags,
   and the ``keep`` mask of the columns to code;
2. and 3. ``ops.quant_stats.quantize_into``: the row norms without the flagged columns (and
   the ``k`` columns' exact values), then the codes and the scale statistics.

The payload is the eager path's, but for two things: the sums (hence the scores) are summed in
another order than torch's ``vector_norm``, so a channel whose score is within a few ulps of
the threshold, or of another's at the capacity's edge, may be picked the other way; and among
tied scores (every score ``-inf`` when the sums do not vary) the kept channels are the lowest,
where ``torch.topk`` picks its own. Either way the flagged channels decode exactly and the rest
within the codec's bound. The verdict's values come in one fp32 tensor: ``[outlier count, max
row norm, sampled row norms..., scale bounds...]``.
"""

from __future__ import annotations

import functools

import torch

from slimact.ops.quant import Quantized
from slimact.ops.quant_stats import quantize_into, stats_size

_COL_BLOCK = 32  # columns per program of the column kernel
_ROW_CHUNK = 64  # rows per step of its loop
_SELECT_CHUNK = 1024  # channels per step of the last program's passes
_TICKETS: dict[torch.device, torch.Tensor] = {}


@functools.cache
def column_kernel():
    """The column kernel (module docstring), defined on first use (``TRITON_INTERPRET``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def columns(X, S, Z, SEL, KEEP, IDX, FLAG, OUT, TICKET, R, C, k, threshold,
                RB: tl.constexpr, CB: tl.constexpr, TB: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        cols = pid * CB + tl.arange(0, CB)
        cmask = cols < C
        acc = tl.zeros([CB], dtype=tl.float32)
        for r0 in range(0, R, RB):
            rows = r0 + tl.arange(0, RB)
            m = (rows[:, None] < R) & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * C + cols[None, :]
            acc += tl.sum(tl.abs(tl.load(X + offs, mask=m, other=0.0).to(tl.float32)), axis=0)
        tl.store(S + cols, acc, mask=cmask)
        ticket = tl.atomic_add(TICKET, 1)  # acq_rel: every other program's sums are visible
        if ticket == tl.num_programs(0) - 1:
            tl.store(TICKET, 0)
            ar = tl.arange(0, TB)
            nf = tl.zeros([TB], dtype=tl.float32)
            sf = tl.zeros([TB], dtype=tl.float32)
            for c0 in range(0, C, TB):
                s = tl.load(S + c0 + ar, mask=c0 + ar < C, other=float("inf"), volatile=True)
                fin = s < float("inf")
                nf += fin.to(tl.float32)
                sf += tl.where(fin, s, 0.0)
            count = tl.sum(nf, axis=0)
            n = tl.maximum(count, 1.0)
            mu = tl.div_rn(tl.sum(sf, axis=0), n)
            sq = tl.zeros([TB], dtype=tl.float32)
            for c0 in range(0, C, TB):
                s = tl.load(S + c0 + ar, mask=c0 + ar < C, other=float("inf"), volatile=True)
                d = tl.where(s < float("inf"), s - mu, 0.0)
                sq += d * d
            sigma = tl.sqrt_rn(tl.div_rn(tl.sum(sq, axis=0), n))
            valid = (count >= 2.0) & (sigma > 0.0)
            den = tl.maximum(sigma, 1.1754943508222875e-38)
            nout = tl.zeros([TB], dtype=tl.float32)
            for c0 in range(0, C, TB):
                cm = c0 + ar < C
                s = tl.load(S + c0 + ar, mask=cm, other=0.0, volatile=True)
                z = tl.where(valid, tl.div_rn(s - mu, den), -float("inf"))
                z = tl.where(s < float("inf"), z, float("inf"))
                tl.store(Z + c0 + ar, z, mask=cm)
                tl.store(SEL + c0 + ar, tl.zeros([TB], dtype=tl.uint8), mask=cm)
                nout += (cm & (z > threshold)).to(tl.float32)
            tl.store(OUT, tl.sum(nout, axis=0))
            tl.debug_barrier()
            for _ in range(0, k):  # the k largest scores, one at a time
                best = tl.full([], -float("inf"), tl.float32)
                at = tl.full([], C, tl.int32)
                for c0 in range(0, C, TB):
                    cm = c0 + ar < C
                    z = tl.load(Z + c0 + ar, mask=cm, other=0.0)
                    free = cm & (tl.load(SEL + c0 + ar, mask=cm, other=1) == 0)
                    mx = tl.max(tl.where(free, z, -float("inf")), axis=0)
                    ix = tl.min(tl.where(free & (z == mx), c0 + ar, C), axis=0)
                    take = (mx > best) | ((mx == best) & (ix < at))
                    best = tl.where(take, mx, best)
                    at = tl.where(take, ix, at)
                tl.store(SEL + at, 1, mask=at < C)
                tl.debug_barrier()
            taken = tl.full([], 0, tl.int32)
            for c0 in range(0, C, TB):
                cm = c0 + ar < C
                sel = tl.load(SEL + c0 + ar, mask=cm, other=0).to(tl.int32)
                flag = (sel != 0) & (tl.load(Z + c0 + ar, mask=cm, other=0.0) > threshold)
                tl.store(KEEP + c0 + ar, (~flag).to(tl.uint8), mask=cm)
                pos = taken + tl.cumsum(sel, axis=0) - 1
                tl.store(IDX + pos, (c0 + ar).to(tl.int32), mask=sel != 0)
                tl.store(FLAG + pos, flag.to(tl.uint8), mask=sel != 0)
                taken += tl.sum(sel, axis=0)

    return columns


def _ticket(device: torch.device) -> torch.Tensor:
    """The column kernel's ticket counter on ``device``: zero between calls (the last program
    resets it), allocated once."""
    t = _TICKETS.get(device)
    if t is None:
        t = _TICKETS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def outlier_quantize_triton(
    x2d: torch.Tensor,
    k: int,
    threshold: float,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    paper_scale: bool,
    rounding: str,
    seed: int,
) -> tuple[Quantized, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The deferred outlier encode of a non-empty ``[R, C]`` ``x2d`` with capacity ``k``
    (module docstring): (codes, verdict statistics, indices int32 ``[k]``, flags bool ``[k]``,
    exact values ``[R, k]``)."""
    x2d = x2d.contiguous()
    r, c = x2d.shape
    dev = x2d.device
    stats = torch.empty(1 + stats_size(r, symmetric), dtype=torch.float32, device=dev)
    scores = torch.empty(2 * c, dtype=torch.float32, device=dev)
    masks = torch.empty(2 * c + k, dtype=torch.uint8, device=dev)
    idx = torch.empty(k, dtype=torch.int32, device=dev)
    val = torch.empty(r, k, dtype=x2d.dtype, device=dev)
    sel, keep, flags = masks[:c], masks[c : 2 * c], masks[2 * c :]
    column_kernel()[(-(-c // _COL_BLOCK),)](
        x2d, scores[:c], scores[c:], sel, keep, idx, flags, stats, _ticket(dev), r, c, k,
        float(threshold), RB=_ROW_CHUNK, CB=_COL_BLOCK, TB=_SELECT_CHUNK,
    )  # fmt: skip
    q = quantize_into(
        x2d.view(-1), c, stats[1:], bits=bits, group_size=group_size, symmetric=symmetric,
        paper_scale=paper_scale, rounding=rounding, seed=seed, keep=keep if k else None,
        idx=idx if k else None, val=val if k else None,
    )  # fmt: skip
    return q, stats, idx, flags.view(torch.bool), val
