"""Outlier-separated INT4 (adacc.txt §3.2, Fig. 3c): exact outlier channels + INT4 for the rest.

LLM activations carry a few *channels* (columns of the ``[tokens, hidden]`` view) whose values
are far larger than the rest; quantizing them together with normal values wastes the INT4 range
on them. Adacc scores each channel ``i`` by the absolute sum ``S_i = sum_rows |x[:, i]|`` and its
Z-score (Eq. 1)::

    Z_i = (S_i - mean(S)) / std(S)          outlier  <=>  Z_i > threshold   (3 by default)

Outlier columns are stored exactly (original dtype) with their indices; they are zeroed in place
of a copy (fused into the quantize kernel's load), and the whole tensor is quantized per group in
its original memory layout (no transpose, Fig. 3b(iii)). Decode dequantizes, then writes the
outlier columns back. Cost: ``rows * k`` original-precision values + ``k`` int32 indices on top of
INT4, so the compression rate falls as outliers appear (adacc.txt Fig. 4: the count changes
during training; :func:`count_outlier_channels` is what a planner tracks).

Non-finite values: a channel holding NaN/inf has a non-finite sum and is always an outlier, so
those values take the exact path (``nonfinite="raise"`` refuses them instead; beyond a deferred
encode's capacity they are coded in band, exactly, by ``slimact.ops.quant``). Z-scores use the
finite sums only; with fewer than two channels, or ``std == 0``, there are no outliers.

``rounding="stochastic"`` rounds the quantized channels stochastically (unbiased, see
``slimact.codecs.quant``); the exact channels are exact either way. A deferred encode draws
what the checked encode of the same seed draws (the draws depend on the seed and the element
index only), so the two stay bit for bit alike while the count is within the capacity.

Extreme finite values (squares overflowing float32, rows beyond ``max_range`` times the median
row, at most 8x for the symmetric codecs: massive activations, ``codecs.quant.range_limit``)
store the whole tensor exactly, as in ``slimact.codecs.quant`` (``row_stats``).

**Without a sync** (:meth:`OutlierCodec.encode_deferred`): how many channels are outliers is
data, and a payload sized by it needs the count on the host. A deferred encode therefore stores
a fixed number of channels exactly, the site's *capacity* (the most outliers its checked encodes
found, kept in the site's state): the top-``capacity`` Z-scores (``torch.topk``, on the device)
with a flag each for "is an outlier". Only the flagged ones are zeroed before quantizing and
written back on decode, so while the count is within the capacity the decoded tensor is the
checked encode's, bit for bit (a resumed run, which starts with checked encodes, trains the
same). Its verdict carries the range and scale checks of ``slimact.codecs.quant`` and the
outlier count: more outliers than the capacity (the ones left out were quantized with the rest,
within the codec's bound) raise the site's capacity from its next save on. On the Triton path a
deferred encode without a row split is three launches (``ops.outlier_triton``: the channels'
sums and their selection, the row norms, the codes) and a decode one (the dequantize kernel
writes the exact channels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimact.codecs.base import (
    Codec,
    CodecConfig,
    Deferred,
    Packed,
    codec_name,
    exact_value,
    register_codec,
)
from slimact.codecs.quant import (
    DEFAULT_MAX_RANGE,
    check_common,
    check_group_size,
    check_input,
    check_max_range,
    explainer,
    quantized_from,
    quantized_payload,
    quantized_problem,
    rounding_args,
    row_group,
    rows_view,
    scale_problem,
    use_triton,
    verdict,
)
from slimact.codecs.rows import (
    DYNAMIC_RANGE,
    calibrate_rows,
    deferred_rows,
    massive_rows,
    range_limit,
    restore_rows,
    row_norms,
    rows_explain,
    split_rows,
    stats_of,
)
from slimact.ops import compiled_ref, device_path
from slimact.ops.outlier_triton import outlier_quantize_triton
from slimact.ops.quant import dequantize, dequantize_triton, quantize
from slimact.ops.quant_stats import stats_layout


def channel_abs_sums(x2d: torch.Tensor) -> torch.Tensor:
    """fp32 ``sum_rows |x[:, c]|`` of an [R, C] tensor without materializing ``|x|`` (on CPU,
    compiled: eager, this column reduction is slow on CPU)."""
    return compiled_ref.run(channel_abs_sums_ref, x2d)


def channel_abs_sums_ref(x2d: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(x2d.dtype, torch.float32)  # float64 sums a float64 tensor
    return torch.linalg.vector_norm(x2d, ord=1, dim=0, dtype=acc)


def outlier_scores(x2d: torch.Tensor) -> torch.Tensor:
    """fp32 [C] abs-sum Z-scores of the channels, on the device (no sync): +inf for a channel
    with a non-finite sum, -inf for every channel when there are fewer than two finite sums or
    they do not vary (no outliers then). Mean and std are over the finite sums.

    On CUDA the sums and the scores are one ref (compiled inside
    ``compiled_ref.compiled_refs_on_cuda()``, else the same ops eagerly); on CPU the sums are
    compiled and the scores of the ``[C]`` sums run eagerly."""
    if device_path.takes_cuda_path(x2d):
        return compiled_ref.run(outlier_scores_ref, x2d.detach())
    return _z_scores(channel_abs_sums(x2d))


def outlier_scores_ref(x2d: torch.Tensor) -> torch.Tensor:
    return _z_scores(channel_abs_sums_ref(x2d))


def _z_scores(s: torch.Tensor) -> torch.Tensor:
    """:func:`outlier_scores` of the channels' abs sums ``s`` (>= 0, or +inf / NaN)."""
    finite = s < float("inf")  # isfinite for sums of magnitudes (NaN compares false)
    n = finite.sum().clamp_min(1)
    sf = torch.where(finite, s, 0.0)
    mu = sf.sum() / n
    sigma = (torch.where(finite, s - mu, 0.0).square().sum() / n).sqrt()
    z = (s - mu) / sigma.clamp_min(torch.finfo(torch.float32).tiny)
    valid = (n >= 2) & (sigma > 0)
    return torch.where(finite, torch.where(valid, z, -float("inf")), float("inf"))


def outlier_mask(x2d: torch.Tensor, threshold: float = 3.0) -> torch.Tensor:
    """Bool [C]: True for channels whose abs-sum Z-score exceeds ``threshold`` or is not finite."""
    return outlier_scores(x2d) > threshold


def outlier_count(x: torch.Tensor, threshold: float = 3.0, channels: int = 0) -> torch.Tensor:
    """:func:`count_outlier_channels` as a 0-d int64 tensor on ``x``'s device (no sync)."""
    if not x.is_floating_point() or x.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    c = channels or x.shape[-1]
    return outlier_mask(x.contiguous().view(-1, c), threshold).sum()


def count_outlier_channels(x: torch.Tensor, threshold: float = 3.0, channels: int = 0) -> int:
    """Number of outlier channels of ``x`` ([-1, channels] view; last dim when 0); a host read
    of :func:`outlier_count`."""
    return int(outlier_count(x, threshold, channels))


@dataclass(frozen=True)
class OutlierConfig(CodecConfig):
    """Outlier channels exact, the rest per-group INT4/INT8 in place (``channels=0``: last dim)."""

    bits: int = 4
    group_size: int = 128
    threshold: float = 3.0
    symmetric: bool = True
    paper_scale: bool = False
    channels: int = 0
    nonfinite: str = "exact"
    backend: str = "auto"
    max_range: float | None = DEFAULT_MAX_RANGE
    rounding: str = "nearest"  # or "stochastic" (slimact.codecs.quant)

    def __post_init__(self) -> None:
        check_common(self, self.bits, self.nonfinite, self.backend, self.rounding)
        check_group_size(self, self.group_size)
        check_max_range(self, self.max_range)
        if not isinstance(self.threshold, (int, float)) or not self.threshold > 0:
            raise ValueError(
                f"OutlierConfig.threshold must be a number > 0, got {self.threshold!r}"
            )
        if not isinstance(self.channels, int) or self.channels < 0:
            raise ValueError(f"OutlierConfig.channels must be an int >= 0, got {self.channels!r}")


class OutlierCodec(Codec):
    config: OutlierConfig

    @property
    def limit(self) -> float | None:
        c = self.config
        return range_limit(c.bits, c.symmetric, c.max_range)

    def _quantize(self, x2d: torch.Tensor, keep: torch.Tensor | None, rounding: dict):
        c = self.config
        return quantize(
            x2d, bits=c.bits, group_size=row_group(c.group_size, x2d.shape[1]), symmetric=c.symmetric,
            paper_scale=c.paper_scale, keep_cols=keep, backend=c.backend, **rounding,
        )  # fmt: skip

    def encode(self, x: torch.Tensor) -> Packed:
        check_input(self, x)
        if (exact := self.float64_exact(x)) is not None:
            return exact
        c, limit = self.config, self.limit
        x2d = rows_view(self, x, c.channels)
        out_mask = outlier_mask(x2d, c.threshold) if x.numel() else x2d.new_zeros(1, dtype=bool)
        idx = out_mask.nonzero().view(-1)
        if c.nonfinite == "raise" and x.numel() and not bool(torch.isfinite(x2d).all()):
            raise ValueError(
                f"codec {codec_name(c)!r}: non-finite value(s) (NaN/inf) in a tensor of shape "
                f"{tuple(x.shape)}; nonfinite='raise' (use 'exact' to keep them)"
            )
        keep = ~out_mask if idx.numel() else None
        rn = row_norms(x2d, keep) if limit is not None and x.numel() else None
        stats = None if rn is None else stats_of(rn)
        rounding = rounding_args(self)
        q = self._quantize(x2d, keep, rounding)
        reason = quantized_problem(x2d, 0, limit, stats, q)
        if reason is None:
            return self._packed(x, x2d, q, idx)
        if c.symmetric and reason.startswith(DYNAMIC_RANGE):
            rows_idx = massive_rows(rn, stats, limit)
            if rows_idx is not None:  # the same draws as the first quantize
                zeroed, rows = split_rows(x2d, rows_idx)
                q = self._quantize(zeroed, keep, rounding)
                if scale_problem(q) is None:
                    return self._packed(x, x2d, q, idx, rows)
        return self.fallback(x, reason)

    def _packed(self, x, x2d, q, idx, rows: dict | None = None, val=None) -> Packed:
        c = self.config
        tensors = quantized_payload(q)
        if idx.numel():
            tensors["outlier_idx"] = idx.to(torch.int32)
            # [rows, k], original dtype
            tensors["outlier_val"] = x2d.index_select(1, idx) if val is None else val
        meta = {
            "numel": q.numel,
            "bits": c.bits,
            "group_size": q.group_size,
            "channels": x2d.shape[1],
            "n_outliers": int(idx.numel()),
        }
        if rows is not None:
            tensors.update(rows)
            meta["n_rows"] = rows["row_idx"].numel()
        return Packed(tensors, tuple(x.shape), x.dtype, x.device, meta)

    def calibrate(self, packed: Packed, state: dict) -> None:
        if "n_outliers" in packed.meta:
            state["capacity"] = max(state.get("capacity", 0), packed.meta["n_outliers"])
        calibrate_rows(packed, state)

    def encode_deferred(self, x: torch.Tensor, state: dict) -> Deferred:
        c, limit = self.config, self.limit
        if c.nonfinite == "raise" or x.numel() == 0 or x.dtype == torch.float64:
            return Deferred(self.encode(x))
        if self.fuses(x, state):
            return self._encode_fused(x, state)
        check_input(self, x)
        x2d = rows_view(self, x, c.channels)
        scores = outlier_scores(x2d)
        outlier = scores > c.threshold
        count = outlier.sum()
        k = min(state.get("capacity", 0), x2d.shape[1])
        keep = flags = None
        idx = scores.new_zeros(0, dtype=torch.int64)
        if k:  # the top-k scores: every outlier while the count is within the capacity
            idx = torch.topk(scores, k, sorted=False).indices.sort().values
            flags = outlier.index_select(0, idx)
            keep = torch.ones_like(outlier).index_copy_(0, idx, ~flags)  # the flagged zeroed
        rn = row_norms(x2d, keep) if limit is not None else None
        stats = None if rn is None else stats_of(rn)
        k_rows = min(state.get("rows", 0), x2d.shape[0]) if rn is not None and c.symmetric else 0
        rows = None
        if k_rows:
            x2d_q, rows, stats, n_rows = deferred_rows(x2d, rn, stats, limit, k_rows)
        q = self._quantize(x2d_q if k_rows else x2d, keep, rounding_args(self))
        packed = self._packed(x, x2d, q, idx, rows)
        if flags is not None:
            packed.tensors["outlier_flag"] = flags  # which stored channels are outliers
        parts, problem = verdict(stats, q, limit)
        if k_rows:
            problem = rows_explain(state, problem, limit, x2d.shape[0], stats.numel())
            parts = [n_rows.view(1), *parts]

        def explain(values: list[float]) -> str | None:
            if values[0] > state.get("capacity", 0):
                state["capacity"] = int(values[0])  # outliers beyond it were quantized
            return problem(values[1:])

        return Deferred(packed, [count.view(1), *parts], explain)

    def fuses(self, x: torch.Tensor, state: dict) -> bool:
        """Does a deferred encode of ``x`` take the fused Triton path
        (``ops.outlier_triton``)? On the Triton path, with a range check and no row split
        (the site's capacity of massive rows is 0)."""
        return (
            self.limit is not None
            and x.numel() > 0
            and not (self.config.symmetric and state.get("rows", 0))
            and use_triton(x, self.config.backend)
            and device_path.fused_codecs()
        )

    def _encode_fused(self, x: torch.Tensor, state: dict) -> Deferred:
        """:meth:`encode_deferred` without a row split in three kernels
        (``ops.outlier_triton``): the same payload, the verdict's values in one tensor."""
        check_input(self, x)
        c, limit = self.config, self.limit
        x2d = rows_view(self, x, c.channels)
        k = min(state.get("capacity", 0), x2d.shape[1])
        q, stats, idx, flags, val = outlier_quantize_triton(
            x2d, k, c.threshold, bits=c.bits, group_size=row_group(c.group_size, x2d.shape[1]),
            symmetric=c.symmetric, paper_scale=c.paper_scale, **rounding_args(self),
        )  # fmt: skip
        packed = self._packed(x, x2d, q, idx, None, val)
        if k:
            packed.tensors["outlier_flag"] = flags
        problem = explainer(stats_layout(x2d.shape[0], c.symmetric)[2], True, limit)

        def explain(values: list[float]) -> str | None:
            if values[0] > state.get("capacity", 0):
                state["capacity"] = int(values[0])  # outliers beyond it were quantized
            return problem(values[1:])

        return Deferred(packed, [stats], explain)

    def decode(self, packed: Packed) -> torch.Tensor:
        if (y := exact_value(packed)) is not None:
            return y
        q = quantized_from(packed)
        q.channels = 0  # the codes are per group; ``channels`` only shapes the outlier view
        t = packed.tensors
        fused = use_triton(q.codes, self.config.backend) and device_path.fused_codecs()
        if fused and "outlier_idx" in t and "row_idx" not in t:
            cols = (packed.meta["channels"], t["outlier_idx"], t.get("outlier_flag"),
                    t["outlier_val"])  # fmt: skip
            return dequantize_triton(q, packed.dtype, cols).view(packed.shape)  # one launch
        y = dequantize(q, dtype=packed.dtype, backend=self.config.backend)
        y2d = y.view(-1, packed.meta["channels"])
        if "outlier_idx" in t:
            idx, val = t["outlier_idx"].long(), t["outlier_val"].to(y.dtype)
            if "outlier_flag" in t:  # a deferred encode's: the others stay as decoded
                val = torch.where(t["outlier_flag"], val, y2d.index_select(1, idx))
            y2d.index_copy_(1, idx, val)
        restore_rows(y2d, packed)
        return y.view(packed.shape)


register_codec("int4-outlier", OutlierConfig(), OutlierCodec)
register_codec("int8-outlier", OutlierConfig(bits=8), OutlierCodec)
# the int4 strategy's choice for linear/norm/activation inputs (groups of 16: grad cosine 0.991
# against 0.982 with 128 on llama-20m), a planner candidate under its own name
register_codec("int4-outlier-g16", OutlierConfig(group_size=16), OutlierCodec)
