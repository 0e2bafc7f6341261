"""Row statistics of a saved tensor: the range checks of the INT and PRAC codecs and the row split.

The codecs view a saved tensor as ``[rows, C]`` (rows are tokens). :func:`row_stats` takes the
row norms in one pass and samples at most 256 of them; the range checks (``codecs.quant``'s
module docstring: overflowing magnitudes, a row beyond ``max_range`` times the median row,
massive activations under :data:`MASSIVE_RANGE`) read them on the host (:func:`stats_ok`) or
on the device (:func:`stats_bad`, no sync). A few massive rows above a tight bulk (a massive
token) are stored exactly on their own, the rest coded (:func:`massive_rows`,
:func:`split_rows`, and :func:`deferred_rows` with the site's capacity, without a sync);
a massive component in every row keeps the whole tensor exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from slimact.codecs.base import Packed
from slimact.ops import compiled_ref

MASSIVE_RANGE = 8.0  # symmetric per-group codecs: rows beyond it mark massive activations
SPLIT_SHARE = 8  # a row split stores at most 1 / SPLIT_SHARE of a tensor's rows exactly
DYNAMIC_RANGE = "dynamic range"
_MEDIAN_SAMPLE = 256


def range_limit(bits: int, symmetric: bool, max_range: float | None) -> float | None:
    """The dynamic range a per-group codec codes: ``max_range``, and for a symmetric one at most
    :data:`MASSIVE_RANGE` (module docstring, massive activations). ``None``: no check."""
    if max_range is None or not symmetric:
        return max_range
    return min(max_range, MASSIVE_RANGE)


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(rows.dtype, torch.float32)  # float64 rows: float64 norms
    return torch.linalg.vector_norm(rows, dim=-1, dtype=acc)


def row_stats(
    x: torch.Tensor, channels: int, max_range: float | None, keep_cols: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Device fp32 ``[max row norm, norms of at most 256 evenly spaced rows]`` (no sync), or None
    when there is nothing to check.

    One pass computing the row norms of the ``[rows, C]`` view (``C = channels``, or the last
    dimension; NaN/inf count as 0: the codecs keep them exactly on their own path; columns
    ``keep_cols`` marks False, an outlier codec's exact channels, count as 0 too);
    :func:`stats_ok` reads them on the host, :func:`stats_bad` decides on the device. Sorting on
    the device for the median is what made a first version slow (a full ``nanmedian`` over
    every row); the sample is at most 257 values.
    """
    if max_range is None or x.numel() == 0 or not x.is_floating_point():
        return None
    return stats_of(row_norms(_rows(x, channels), keep_cols))


def row_norms(rows: torch.Tensor, keep_cols: torch.Tensor | None = None) -> torch.Tensor:
    """The norms of the rows of an ``[R, C]`` view (:func:`row_stats`), on the device."""
    with torch.no_grad():  # CPU: one fused pass
        return compiled_ref.run(row_norms_ref, rows.detach(), keep_cols)


def row_norms_ref(rows: torch.Tensor, keep_cols: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`row_norms`: non-finite values become 0 in one pass (``nan_to_num``: eager,
    ``where(isfinite(x), x, 0)`` is five)."""
    rows = rows.nan_to_num(0.0, 0.0, 0.0)
    if keep_cols is not None:
        rows = torch.where(keep_cols, rows, 0.0)
    return _row_norms(rows)


def stats_of(rn: torch.Tensor) -> torch.Tensor:
    """:func:`row_stats` of the row norms ``rn``: ``[max, every (R // 256)-th norm]``."""
    return torch.cat([rn.max().view(1), rn[:: max(1, rn.numel() // _MEDIAN_SAMPLE)]])


def row_stats_ref(rows: torch.Tensor) -> torch.Tensor:
    """:func:`row_stats` of an ``[R, C]`` view."""
    return stats_of(row_norms_ref(rows))


def stats_ok(stats: torch.Tensor, max_range: float) -> bool:
    """Host side of :func:`row_stats`: False for overflowing norms and for a max beyond
    ``max_range`` times the sampled rows' median nonzero norm. An all-zero tensor is fine."""
    top, sample = stats[0], stats[1:]
    sample = sample[sample > 0]
    if not bool(torch.isfinite(top)):
        return False
    if sample.numel() == 0:
        return True
    return bool(top <= max_range * sample.median())


def stats_bad(stats: torch.Tensor, max_range: float) -> torch.Tensor:
    """Device side of :func:`stats_ok` (its negation, a 0-d bool), without a sync: the median of
    the positive sampled norms is read from a sort with the others moved to the end (the lower
    middle, as ``torch.median``)."""
    top, (n, median) = stats[0], sample_median(stats)
    return ~torch.isfinite(top) | ((n > 0) & (top > max_range * median))


def sample_median(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: the number of positive sampled norms of :func:`row_stats` and their
    median, read from a sort with the others moved to the end (the lower middle, as
    ``torch.median``; +inf when none is positive)."""
    sample = stats[1:]
    pos = sample > 0
    n = pos.sum()
    ordered = torch.where(pos, sample, float("inf")).sort().values
    return n, ordered.gather(0, ((n - 1).clamp_min(0) // 2).view(1))[0]


def range_problem(x: torch.Tensor, channels: int, max_range: float | None) -> str | None:
    """Why ``x`` is outside what the lossy codecs represent faithfully, or None (see module doc).

    Non-finite values are ignored here (the codecs keep them exactly on their own path).
    """
    stats = row_stats(x, channels, max_range)
    if stats is None or stats_ok(stats.cpu(), max_range):
        return None
    with torch.no_grad():
        return _range_reason(_rows(x, channels), max_range)


def _rows(x: torch.Tensor, channels: int) -> torch.Tensor:
    return x.detach().reshape(-1, channels or (x.shape[-1] if x.dim() else 1))


def _range_reason(
    rows: torch.Tensor, max_range: float, stats: torch.Tensor | None = None
) -> str | None:
    """Why the row statistics ``stats`` (host; computed from ``rows`` when None) fail
    :func:`stats_ok`, or None."""
    if stats is None:
        stats = row_stats_ref(rows).cpu()
    if not bool(torch.isfinite(stats[0])):
        amax = float(torch.where(torch.isfinite(rows), rows, 0.0).abs().amax())
        return f"|x| up to {amax:.3g}: its squares overflow float32"
    if stats_ok(stats, max_range):
        return None
    top, sample = stats[0], stats[1:]
    med = sample[sample > 0].median()
    return (
        f"{DYNAMIC_RANGE}: a row's norm is {float(top / med):.3g}x the median row's "
        f"(max_range={max_range:g})"
    )


def stats_ok_values(values: list[float], max_range: float) -> bool:
    """:func:`stats_ok` on host values."""
    top = values[0]
    sample = sorted(v for v in values[1:] if v > 0)
    if not math.isfinite(top):
        return False
    return not sample or top <= max_range * sample[(len(sample) - 1) // 2]


def massive_rows(rn: torch.Tensor, stats: torch.Tensor, limit: float) -> torch.Tensor | None:
    """The checked encode's row split (module docstring; reads the device): the indices of the
    rows whose norms ``rn`` exceed ``limit`` times the median row's (:func:`sample_median` of
    ``stats``, as a deferred encode computes it), or None when the range problem is not a few
    massive rows above a tight bulk: the sampled positive norms spread beyond ``limit`` (a massive
    component in every row, whose small rest no row's groups keep), non-finite norms, or more
    than ``1 / SPLIT_SHARE`` of the rows massive. The whole tensor is then stored exactly."""
    host = stats.cpu()
    sample = host[1:][host[1:] > 0]
    if not bool(torch.isfinite(host[0])) or sample.numel() == 0:
        return None
    if float(sample.min()) * limit < float(sample.median()):
        return None
    idx = (rn > limit * sample_median(stats)[1]).nonzero().view(-1)
    if idx.numel() == 0 or idx.numel() * SPLIT_SHARE > rn.numel():
        return None
    return idx


def split_rows(
    x2d: torch.Tensor, idx: torch.Tensor, flags: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``x2d`` with rows ``idx`` (those ``flags`` marks, when given) zeroed, to quantize in its
    place (so that no group spanning two rows codes a normal one at a massive one's step), and
    the payload tensors that store those rows exactly (:func:`restore_rows`)."""
    val = x2d.index_select(0, idx)
    if flags is None:
        zeroed = x2d.index_fill(0, idx, 0.0)
        return zeroed, {"row_idx": idx.to(torch.int32), "row_val": val}
    zeroed = x2d.index_copy(0, idx, torch.where(flags.view(-1, 1), 0.0, val).to(x2d.dtype))
    return zeroed, {"row_idx": idx.to(torch.int32), "row_val": val, "row_flag": flags}


def deferred_rows(
    x2d: torch.Tensor, rn: torch.Tensor, stats: torch.Tensor, limit: float, k: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A deferred encode's row split, without a sync: the ``k`` (the site's capacity) rows of
    largest norm are stored exactly where flagged massive (:func:`massive_rows`'s rule), as
    :func:`split_rows`. Returns the tensor to quantize, the payload tensors, the row statistics
    of the rows left to the codes (for :func:`verdict`) and the count of massive rows."""
    threshold = limit * sample_median(stats)[1]
    idx = torch.topk(rn, k, sorted=False).indices.sort().values
    top = rn.index_select(0, idx)
    flags = top > threshold
    zeroed, tensors = split_rows(x2d, idx, flags)
    rest = rn.index_copy(0, idx, torch.where(flags, 0.0, top))
    return zeroed, tensors, torch.cat([rest.max().view(1), stats[1:]]), (rn > threshold).sum()


def rows_explain(
    state: dict,
    explain: Callable[[list[float]], str | None],
    limit: float,
    n_rows: int,
    n_stats: int,
) -> Callable[[list[float]], str | None]:
    """A deferred row split's verdict: the count of massive rows first (it raises the site's
    capacity, ``state["rows"]``, up to ``1 / SPLIT_SHARE`` of the rows), then the row statistics
    of :func:`deferred_rows` (rows above a spread bulk are reported: the checked encode stores
    such a tensor whole), then ``explain``'s values."""

    def explain_rows(values: list[float]) -> str | None:
        count = int(values[0])
        state["rows"] = max(state.get("rows", 0), min(count, n_rows // SPLIT_SHARE))
        pos = sorted(v for v in values[2 : 1 + n_stats] if v > 0)
        if count and pos and pos[0] * limit < pos[(len(pos) - 1) // 2]:
            return f"{DYNAMIC_RANGE}: massive rows above rows of spread norms"
        return explain(values[1:])

    return explain_rows


def restore_rows(y2d: torch.Tensor, packed: Packed) -> None:
    """Write the rows a row split stored exactly back into the decoded ``[R, C]`` view."""
    t = packed.tensors
    if "row_idx" not in t:
        return
    idx, val = t["row_idx"].long(), t["row_val"].to(y2d.dtype)
    if "row_flag" in t:
        val = torch.where(t["row_flag"].view(-1, 1), val, y2d.index_select(0, idx))
    y2d.index_copy_(0, idx, val)


def calibrate_rows(packed: Packed, state: dict) -> None:
    """A checked encode's row split sets the site's capacity (:func:`deferred_rows`)."""
    if "n_rows" in packed.meta:
        state["rows"] = max(state.get("rows", 0), packed.meta["n_rows"])
