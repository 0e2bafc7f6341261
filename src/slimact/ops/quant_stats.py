"""Per-group quantize+pack with the INT codecs' verdict statistics, in two Triton launches.

A deferred encode (``codecs.quant``: ``QuantCodec.encode_deferred``) needs, besides the codes,
the statistics its verdict reads on the host after the step: the row norms of the ``[R, C]``
view (their maximum and every ``step``-th one, ``step = max(1, R // 256)``:
``codecs.rows.row_stats``) and the scales' magnitude bounds (``codecs.quant.scale_stats``).
Eagerly on CUDA those are two dozen small kernels per saved tensor; here they are two:

1. ``row_norm_kernel`` (``ops.quant_triton``): the row norms, the sampled ones written in place,
   a partial maximum per program, and the scale statistics' initial values;
2. ``quant_kernel`` with ``STATS``: the codes and scales as :func:`ops.quant.quantize_triton`
   writes them (bit for bit), each program's scale bounds gathered by atomic min/max (exact:
   min and max do not depend on the order), and the partial maxima reduced by program 0.

The statistics come back as one fp32 tensor laid out as the eager verdict's parts, concatenated:
``[max row norm, sampled norms..., min scale, max scale(, max |offset|)]``. The scale bounds
equal ``scale_stats_ref``'s bit for bit; the row norms are sums of squares in another order than
torch's ``vector_norm``, so within a few ulps of ``row_stats_ref``'s (the verdict compares them
against limits of 8x and more: such a difference moves no verdict but one on its very edge).
"""

from __future__ import annotations

import torch

from slimact.ops.quant import (
    _CHANNEL_BLOCK,
    Quantized,
    _groups_per_program,
    _limits,
    divisor,
    marked_divisor,
)
from slimact.ops.quant_triton import channel_scale_kernel, kernels, row_norm_kernel
from slimact.ops.stochastic import seed_key

_ROW_TILE = 4096  # values per program of the row-norm kernel
_MAX_COL_BLOCK = 1024


def stats_layout(rows: int, symmetric: bool) -> tuple[int, int, int]:
    """(row step, number of sampled rows, index of the first scale statistic) of ``rows``."""
    step = max(1, rows // 256)
    sampled = -(-rows // step)
    return step, sampled, 1 + sampled


def stats_size(rows: int, symmetric: bool) -> int:
    """Values of the statistics of ``rows`` rows (module docstring)."""
    return stats_layout(rows, symmetric)[2] + (2 if symmetric else 3)


def quantize_with_stats_triton(
    x: torch.Tensor,
    channels: int,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    paper_scale: bool,
    rounding: str,
    seed: int,
) -> tuple[Quantized, torch.Tensor]:
    """``ops.quant.quantize(x, backend="triton")`` of a non-empty ``x`` and its verdict
    statistics (module docstring) for the ``[-1, channels]`` view."""
    x = x.contiguous().view(-1)
    stats = torch.empty(stats_size(x.numel() // channels, symmetric), device=x.device)
    q = quantize_into(
        x, channels, stats, bits=bits, group_size=group_size, symmetric=symmetric,
        paper_scale=paper_scale, rounding=rounding, seed=seed,
    )  # fmt: skip
    return q, stats


def _row_norms(x, c, stats, symmetric, keep=None, idx=None, val=None) -> tuple[torch.Tensor, int]:
    """``row_norm_kernel`` over the ``[-1, c]`` view of ``x``: (partial maxima, their count)."""
    r = x.numel() // c
    step, _, slot = stats_layout(r, symmetric)
    cb = min(1 << (c - 1).bit_length(), _MAX_COL_BLOCK)
    rb = max(1, _ROW_TILE // cb)
    parts = -(-r // rb)
    part = torch.empty(parts, dtype=torch.float32, device=x.device)
    k = 0 if idx is None else idx.numel()
    row_norm_kernel()[(parts,)](
        x, stats, part, r, c, step, slot, stats if keep is None else keep,
        stats if idx is None else idx, stats if val is None else val, k, RB=rb, CB=cb,
        SYM=symmetric, HAS_KEEP=keep is not None, GATHER=k > 0,
    )  # fmt: skip
    return part, parts


def quantize_channelwise_with_stats_triton(
    x2d: torch.Tensor, *, bits: int, paper_scale: bool, rounding: str, seed: int
) -> tuple[Quantized, torch.Tensor]:
    """``ops.quant.quantize_channelwise`` of a non-empty ``[R, C]`` ``x2d`` on the Triton path
    and its verdict statistics (the row norms', then the channel scales' bounds), in three
    launches: the row norms, the scales (``channel_scale_kernel``), the codes."""
    quant_kernel, _ = kernels()
    x = x2d.contiguous().view(-1)
    (r, c), n, dev = x2d.shape, x.numel(), x.device
    stats = torch.empty(stats_size(r, True), dtype=torch.float32, device=dev)
    part, parts = _row_norms(x, c, stats, True)
    scale = torch.empty(c, dtype=torch.float32, device=dev)
    inv = torch.empty(c, dtype=torch.float32, device=dev)
    counts = torch.empty(c, dtype=torch.int32, device=dev)
    channel_scale_kernel()[(-(-c // 32),)](
        x, scale, inv, counts, stats, part, parts, stats_layout(r, True)[2], r, c,
        divisor(bits, True, paper_scale), marked_divisor(bits, True), RB=64, CB=32,
    )  # fmt: skip
    lo, hi, bias = _limits(bits)
    codes = torch.empty((n + 1) // 2 if bits == 4 else n, dtype=torch.uint8, device=dev)
    per = _groups_per_program(_CHANNEL_BLOCK)
    quant_kernel[(-(-n // (_CHANNEL_BLOCK * per)),)](
        x, inv, inv, codes, scale, inv, counts, n, c, 1.0, 1.0, seed_key(seed), inv, inv, 0, 0,
        BLOCK=_CHANNEL_BLOCK, GROUPS=per, BITS=bits, SYM=True, HAS_KEEP=False, PER_CHANNEL=True,
        STOCH=rounding == "stochastic", LO=lo, HI=hi, BIAS=bias, enable_fp_fusion=False,
    )  # fmt: skip
    return Quantized(codes, scale, None, counts, n, bits, 0, channels=c), stats


def quantize_into(
    x: torch.Tensor,
    channels: int,
    stats: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    symmetric: bool,
    paper_scale: bool,
    rounding: str,
    seed: int,
    keep: torch.Tensor | None = None,
    idx: torch.Tensor | None = None,
    val: torch.Tensor | None = None,
) -> Quantized:
    """The two launches (module docstring) of a flat contiguous non-empty ``x``, its statistics
    written to ``stats`` (fp32, :func:`stats_size`). ``keep`` (uint8 ``[channels]``): columns
    zeroed where 0 before the norms and the codes (``ops.quant``'s ``keep_cols``); ``idx``
    (int32 ``[k]``): those columns copied to ``val`` (``[rows, k]``, ``x``'s dtype)."""
    quant_kernel, _ = kernels()
    n, gs, c = x.numel(), group_size, channels
    slot = stats_layout(n // c, symmetric)[2]
    dev = x.device
    part, parts = _row_norms(x, c, stats, symmetric, keep, idx, val)
    stochastic = rounding == "stochastic"
    groups = -(-n // gs)
    lo, hi, bias = _limits(bits)
    codes = torch.empty((n + 1) // 2 if bits == 4 else n, dtype=torch.uint8, device=dev)
    scale = torch.empty(groups, dtype=torch.float32, device=dev)
    offset = None if symmetric else torch.empty(groups, dtype=torch.float32, device=dev)
    nonfinite = torch.empty(groups, dtype=torch.int32, device=dev)
    per = _groups_per_program(gs)
    quant_kernel[(-(-groups // per),)](
        x, scale if keep is None else keep, scale, codes, scale,
        offset if offset is not None else scale, nonfinite, n, c,
        divisor(bits, symmetric, paper_scale, stochastic), marked_divisor(bits, symmetric),
        seed_key(seed), stats, part, parts, slot, BLOCK=gs, GROUPS=per, BITS=bits, SYM=symmetric,
        HAS_KEEP=keep is not None, PER_CHANNEL=False, STOCH=stochastic, LO=lo, HI=hi, BIAS=bias,
        STATS=True, ROWS=True, enable_fp_fusion=False,
    )  # fmt: skip
    return Quantized(codes, scale, offset, nonfinite, n, bits, gs)
