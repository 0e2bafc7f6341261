"""Per-group INT4/INT8 codecs and channel-wise symmetric INT4 (adacc.txt §3.2, Eqs. 2-3).

``int4`` / ``int8`` quantize a saved tensor in memory order, ``group_size`` values per fp32
scale (symmetric, Eq. 2); ``int4-asym`` adds an fp32 offset per group (Eq. 3) for one-sided data
such as softmax probabilities. ``int4-channel`` is the Q/K/V scheme: one symmetric scale per
channel (a column of the ``[rows, channels]`` memory view), no transpose. Math, packing and error
bound (``|x - x^| <= S/2`` per group with the default divisors) are in ``slimact.ops.quant``.

``rounding="stochastic"`` (every codec here, ``codecs.outlier`` and ``codecs.token`` too): codes
``floor(x / S + u)``, ``u ~ U[0, 1)``, instead of to nearest: an unbiased decode (``E[x^] = x``
inside the code range) at ``|x - x^| < S`` per group, so a gradient through the decoded tensor is
unbiased in a linear op, as PRAC's estimator is (prac.txt's argument), where round-to-nearest
leaves a fixed, data-dependent error that the steps do not average out. Same payload, same
bytes; the draws are a hash of a seed and the element index (``slimact.ops.quant``), the seed
the encode's (``Codec.next_seed``: the saving policy's, of the site and its count of encodes),
so a run is reproducible and a resumed run draws as the uninterrupted one. The price: a hash per
value in the quantize pass, twice the per-value error bound, and twice the mean squared error
of one decode for values spread evenly between codes (``S^2/6`` against ``S^2/12``): noise that
averages out over steps in place of an error that does not. Measured in BENCHMARKS.md
(stochastic rounding).

Groups stay within a row (a token) of the ``[rows, C]`` memory view where ``C`` allows it at
most twice the scales (:func:`row_group`): a group spanning a token of massive activations and
a normal one would code the normal one at the massive one's step.

A float64 tensor is stored exactly (``Codec.float64_exact``): the scales and arithmetic here are
float32.

Cost per element of an fp32 tensor (4 bytes): INT4 with groups of 128 stores 0.5 + 4/128 bytes
(7.5x smaller), ``int4-asym`` 0.5 + 8/128, INT8 1 + 4/128; encode is one read and one small
write, decode one small read and one write, against a recomputation that re-runs the op.

Non-finite values (NaN, ±inf) never become finite garbage. With ``nonfinite="exact"`` (the
default) they are coded in band (``slimact.ops.quant``: a marked group's reserved codes decode to
exactly NaN / -inf / +inf, the other values of the group stay within their bound), so the payload
has the same fixed size whatever the data and nothing is read on the host. With
``nonfinite="raise"`` the encode fails (a host read, so a sync on a GPU), and ``CodecPolicy`` adds
the site name to the error. Non-float tensors are rejected with a ``TypeError``; the ``int4``
strategy never sends them.

Extreme finite values are stored exactly (``codecs.base.exact_packed``, reported per site by the
saving policy), never quantized into a wrong finite gradient. :func:`row_stats` checks, in one
extra read of the tensor (row norms of the ``[rows, C]`` view, non-finite values counted as 0),
read with the scale check below in one sync:

* magnitude: values whose squares overflow float32 (|x| ≳ 1e18 per row) — the model is in a
  regime where the kernels' fp32 arithmetic is close to its limits;
* dynamic range: a row (token) whose norm is more than ``max_range`` (256) times the median
  nonzero row's (the median of at most 256 evenly spaced rows). Each group keeps ~3 bits (INT4) relative to its own max, which is within the
  codec's contract, but such a tensor means the model is in a regime where gradients amplify
  those errors: measured on llama-tiny with one ``gate_proj`` weight at 1e4, the residual stream
  has rows ~340x the median, and quantizing the final norm's input alone drops the gradient
  cosine to 0.92 (0.91 for all of ``int4``; 0.996 on normal inputs, where the ratio is < 2).
  ``max_range=None`` turns the check off.
* massive activations under the symmetric per-group codecs (``int4``, ``int8``,
  ``int4-outlier*``): the limit is :data:`MASSIVE_RANGE` (8) instead (:func:`range_limit`). Rows of a normal activation differ by
  less than 2x; trained LLMs carry massive activations (a few tokens, such as the first, with a
  few channels or directions hundreds of times the rest), and the norm reading the residual
  stream (RMSNorm, LayerNorm) is scale invariant: its backward cancels the gradient along ``x``
  almost exactly, and the part of ``x`` that decides the cancellation is the small rest below
  the massive component, which a group's 8 (INT4) or 128 (INT8) levels round away. The error is
  then multiplied by whatever gain wrote the massive component. Two cases:

  - *a few massive rows above a tight bulk* (a massive token): a **row split** stores those
    rows exactly (indices and values, ``row_idx``/``row_val``) and codes the rest, zeroed in
    their place so that no group spanning two rows codes a normal one at a massive one's step
    (:func:`massive_rows`). At most ``1 / SPLIT_SHARE`` of the rows; a deferred encode stores
    its site's capacity of largest rows, flagged (:func:`deferred_rows`), as the outlier codec
    does with channels.
  - *a massive component in every row*, of varying size (the sampled rows' norms themselves
    spread beyond the limit): no row's groups keep its rest, and the whole tensor is stored
    exactly and reported.

  The outlier codec measures rows without its exact channels (a massive channel is its own
  business there). The asymmetric codecs (softmax probabilities, whose rows legitimately
  differ by up to the square root of the sequence length) and the channel-wise ones keep
  ``max_range``.

After quantizing, a scale or offset that is not finite, or a nonzero scale below the kernels'
floor (1e-30: such a group would decode to zeros, outside ``|x − x^| <= S/2``), also falls back.

**Without a sync** (:meth:`QuantCodec.encode_deferred`, what the saving policy calls for a site
whose earlier saves were clean): the same statistics are the verdict (:func:`verdict`: the row
norms and scale bounds, no extra kernel), which the policy copies to the host and reads after
the step without waiting for the device (``slimact.ops.deferred``). The payload is the coded
tensor whatever the verdict: within the codec's bound, NaN/inf exact in band, magnitudes up to
float32's max safe (``ops.quant``); only a group whose values are all below 7e-30 loses its
precision (absolute error below 1.4e-29). A verdict that finds a problem is reported for the
site, which is checked on the host (and stored exactly while the problem lasts) from its next
save on. On the Triton path (CUDA, or a CPU inside ``ops.device_path.cuda_path``) a deferred
encode without a row split is two launches (``ops.quant_stats``: the row norms, then the codes
and the scale bounds; the channel-wise codec three, its scales between), the statistics one
tensor laid out as the eager parts; a decode is one launch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slimact.codecs.base import (
    Codec,
    CodecConfig,
    Deferred,
    Packed,
    check_rounding,
    codec_name,
    exact_value,
    register_codec,
)
from slimact.codecs.rows import (
    DYNAMIC_RANGE,
    _range_reason,
    _rows,
    calibrate_rows,
    deferred_rows,
    massive_rows,
    range_limit,
    range_problem,
    restore_rows,
    row_norms,
    row_stats,
    rows_explain,
    split_rows,
    stats_of,
    stats_ok,
    stats_ok_values,
)
from slimact.ops import compiled_ref, device_path
from slimact.ops.quant import (
    BACKENDS,
    Quantized,
    dequantize,
    quantize,
    quantize_channelwise,
    use_triton,
)
from slimact.ops.quant_stats import (
    quantize_channelwise_with_stats_triton,
    quantize_with_stats_triton,
    stats_layout,
)

__all__ = ["range_problem", "row_stats"]  # re-exported: the range checks live in codecs.rows

NONFINITE_MODES = ("exact", "raise")
DEFAULT_MAX_RANGE = 256.0
SCALE_FLOOR = 1e-30  # slimact.ops.quant._TINY: 1/scale is clamped there
_F32_MAX = torch.finfo(torch.float32).max


def check_max_range(cfg: CodecConfig, max_range: float | None) -> None:
    ok = max_range is None or (
        isinstance(max_range, (int, float)) and not isinstance(max_range, bool) and max_range >= 1
    )
    if not ok:
        raise ValueError(f"{type(cfg).__name__}.max_range must be None or >= 1, got {max_range!r}")


def scale_stats(q: Quantized) -> torch.Tensor | None:
    """Device fp32 ``[min, max]`` of the nonzero scales' magnitudes (a marked group's scale is
    negative, ``ops.quant``) and max |offset|, no sync; None if empty.

    :func:`scales_ok` reads them: outside [1e-30, float32 max], or with a NaN (which propagates),
    a group cannot decode within ``|x - x^| <= S/2``."""
    if q.scale.numel() == 0:
        return None
    if q.offset is None:  # on CUDA, compiled inside compiled_ref.compiled_refs_on_cuda()
        return compiled_ref.run_cuda(scale_stats_ref, q.scale)
    return compiled_ref.run_cuda(scale_stats_ref, q.scale, q.offset)


def scale_stats_ref(scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`scale_stats` of the scales (and offsets)."""
    mag = scale.abs()
    lo, hi = torch.aminmax(torch.where(mag == 0, 1.0, mag))
    parts = [lo.view(1), hi.view(1)]
    if offset is not None:
        parts.append(offset.abs().amax().view(1))
    return torch.cat(parts)


def scales_ok(stats: torch.Tensor) -> bool:
    return bool((stats[0] >= SCALE_FLOOR) & (stats[1:] <= _F32_MAX).all())


def scale_problem(q: Quantized) -> str | None:
    """Why quantized groups cannot decode within ``|x - x^| <= S/2``, or None (one sync)."""
    stats = scale_stats(q)
    if stats is None or scales_ok(stats.cpu()):
        return None
    mag = q.scale.abs()
    bad = ~torch.isfinite(mag) | ((mag > 0) & (mag < SCALE_FLOOR))
    if q.offset is not None:
        bad = bad | ~torch.isfinite(q.offset)
    return (
        f"{int(bad.sum())} group scale(s)/offset(s) outside float32's usable range "
        f"(non-finite, or nonzero below {SCALE_FLOOR:g})"
    )


def quantized_problem(
    x: torch.Tensor,
    channels: int,
    max_range: float | None,
    rows: torch.Tensor | None,
    q: Quantized,
) -> str | None:
    """The reason to store ``x`` exactly after quantizing it to ``q``, or None. ``rows`` are its
    :func:`row_stats` (taken before quantizing); they and :func:`scale_stats` come to the host in
    one copy (one sync)."""
    scales = scale_stats(q)
    parts = [p for p in (rows, scales) if p is not None]
    if not parts:
        return None
    host = torch.cat(parts).cpu()
    n = 0 if rows is None else rows.numel()
    if rows is not None and not stats_ok(host[:n], max_range):
        with torch.no_grad():
            reason = _range_reason(_rows(x, channels), max_range, host[:n])
        if reason is not None:
            return reason
    if scales is not None and not scales_ok(host[n:]):
        return scale_problem(q)
    return None


def verdict(
    rows: torch.Tensor | None, q: Quantized, max_range: float | None
) -> tuple[list[torch.Tensor], Callable[[list[float]], str | None]]:
    """What :func:`quantized_problem` decides on the host, deferred: the device statistics it
    reads (row norms, scales: no extra kernel) and the host function that decides on their
    values once ``slimact.ops.deferred`` has copied them (plain Python, no tensor op)."""
    scales = scale_stats(q)
    parts = [t for t in (rows, scales) if t is not None]
    return parts, explainer(0 if rows is None else rows.numel(), scales is not None, max_range)


def explainer(
    n: int, has_scales: bool, max_range: float | None
) -> Callable[[list[float]], str | None]:
    """:func:`verdict`'s host function of ``n`` row statistics followed by the scale
    statistics (if ``has_scales``)."""

    def explain(values: list[float]) -> str | None:
        if n and not stats_ok_values(values[:n], max_range):
            return (
                f"a row's norm beyond max_range={max_range:g} times the median row's, or "
                f"squares overflowing float32"
            )
        if has_scales and not scales_ok_values(values[n:]):
            return f"group scale(s) outside float32's usable range (nonzero below {SCALE_FLOOR:g})"
        return None

    return explain


def scales_ok_values(values: list[float]) -> bool:
    """:func:`scales_ok` on host values (NaN compares false: not ok)."""
    return values[0] >= SCALE_FLOOR and all(v <= _F32_MAX for v in values[1:])


def row_group(group_size: int, width: int) -> int:
    """The group a per-group codec uses on rows of ``width`` values: ``group_size``, or, where
    that does not divide the row, the largest power of two that does if it is at least half of
    ``group_size`` (at most twice the scales), so that no group spans two rows (tokens). A
    group's step is its largest value over 7 (INT4) or 127 (INT8): a group shared by a token of
    massive activations and a normal token codes the normal one at the massive one's step, and a
    norm's backward, which is per token, amplifies that token's relative error. Other widths keep
    ``group_size`` (their scales would cost more than that)."""
    if width <= 0 or width % group_size == 0:
        return group_size
    aligned = min(group_size, width & -width)
    return aligned if 2 * aligned >= group_size else group_size


def check_common(
    cfg: CodecConfig, bits: int, nonfinite: str, backend: str, rounding: str = "nearest"
) -> None:
    name = type(cfg).__name__
    check_rounding(cfg, rounding)
    if bits not in (4, 8):
        raise ValueError(f"{name}.bits must be 4 or 8, got {bits!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"{name}.nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    if backend not in BACKENDS:
        raise ValueError(f"{name}.backend must be one of {BACKENDS}, got {backend!r}")


def check_group_size(cfg: CodecConfig, group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size & (group_size - 1):
        raise ValueError(
            f"{type(cfg).__name__}.group_size must be a power of two >= 2, got {group_size!r}"
        )


def check_input(codec: Codec, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{codec_name(codec.config)}.encode needs a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"codec {codec_name(codec.config)!r} quantizes floating-point tensors "
            f"(float32, bfloat16, float16); got dtype {x.dtype}"
        )


def refuse_nonfinite(codec: Codec, x: torch.Tensor, counts: torch.Tensor, mode: str) -> None:
    """``nonfinite="raise"``: fail on NaN/inf (a host read of the counts: a sync on a GPU, in
    this opt-in mode only). ``"exact"`` keeps them in band and reads nothing."""
    if mode != "raise" or counts.numel() == 0:
        return
    n = int(counts.sum())
    if n:
        raise ValueError(
            f"codec {codec_name(codec.config)!r}: {n} non-finite value(s) (NaN/inf) in "
            f"a tensor of shape {tuple(x.shape)}; nonfinite='raise' (use 'exact' to keep them)"
        )


def rounding_args(codec: Codec) -> dict:
    """``rounding`` and ``seed`` for ``slimact.ops.quant``: a fresh seed
    (``Codec.next_seed``) per stochastic encode, none for round-to-nearest."""
    if not codec.draws:
        return {"rounding": "nearest", "seed": 0}
    return {"rounding": "stochastic", "seed": codec.next_seed()}


def quantized_from(packed: Packed) -> Quantized:
    t, m = packed.tensors, packed.meta
    return Quantized(
        t["codes"], t["scale"], t.get("offset"), t["scale"].new_empty(0, dtype=torch.int32),
        m["numel"], m["bits"], m["group_size"], m.get("channels", 0),
    )  # fmt: skip


def quantized_payload(q: Quantized) -> dict[str, torch.Tensor]:
    out = {"codes": q.codes, "scale": q.scale}
    if q.offset is not None:
        out["offset"] = q.offset
    return out


@dataclass(frozen=True)
class QuantConfig(CodecConfig):
    """Per-group quantization: ``bits`` 4 or 8, symmetric (Eq. 2) or asymmetric (Eq. 3)."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    paper_scale: bool = False  # adacc.txt's divisors 8/16: the max clips by one step
    nonfinite: str = "exact"
    backend: str = "auto"
    max_range: float | None = DEFAULT_MAX_RANGE  # see range_problem; None: no check
    rounding: str = "nearest"  # or "stochastic": unbiased (module docstring)

    def __post_init__(self) -> None:
        check_common(self, self.bits, self.nonfinite, self.backend, self.rounding)
        check_group_size(self, self.group_size)
        check_max_range(self, self.max_range)


class QuantCodec(Codec):
    config: QuantConfig

    def _quantize(self, x: torch.Tensor, group: int, rounding: dict) -> Quantized:
        c = self.config
        q = quantize(
            x, bits=c.bits, group_size=group, symmetric=c.symmetric,
            paper_scale=c.paper_scale, backend=c.backend, **rounding,
        )  # fmt: skip
        refuse_nonfinite(self, x, q.nonfinite, c.nonfinite)
        return q

    def _packed(self, x: torch.Tensor, q: Quantized, group: int, rows: dict | None) -> Packed:
        meta = {"numel": q.numel, "bits": self.config.bits, "group_size": group}
        tensors = quantized_payload(q)
        if rows is not None:
            tensors.update(rows)
            meta["n_rows"] = rows["row_idx"].numel()
        return Packed(tensors, tuple(x.shape), x.dtype, x.device, meta)

    def _prepare(self, x: torch.Tensor):
        """(group, [R, C] view, its row norms or None, their stats or None)."""
        check_input(self, x)
        x2d = _rows(x, 0)
        rn = row_norms(x2d) if self.max_range is not None and x.numel() else None
        group = row_group(self.config.group_size, x.shape[-1] if x.dim() else 0)
        return group, x2d, rn, None if rn is None else stats_of(rn)

    def encode(self, x: torch.Tensor) -> Packed:
        if (exact := self.float64_exact(x)) is not None:
            return exact
        group, x2d, rn, stats = self._prepare(x)
        rounding = rounding_args(self)
        q = self._quantize(x, group, rounding)
        reason = quantized_problem(x, 0, self.max_range, stats, q)
        if reason is None:
            return self._packed(x, q, group, None)
        if self.splits_rows and reason.startswith(DYNAMIC_RANGE):
            idx = massive_rows(rn, stats, self.max_range)
            if idx is not None:  # the same draws as the first quantize
                zeroed, rows = split_rows(x2d, idx)
                q = self._quantize(zeroed.view(x.shape), group, rounding)
                if scale_problem(q) is None:
                    return self._packed(x, q, group, rows)
        return self.fallback(x, reason)

    @property
    def max_range(self) -> float | None:
        c = self.config
        return range_limit(c.bits, c.symmetric, c.max_range)

    @property
    def splits_rows(self) -> bool:
        """Massive rows are stored exactly on their own (a row split) by the symmetric codecs."""
        return self.config.symmetric and self.max_range is not None

    def calibrate(self, packed: Packed, state: dict) -> None:
        calibrate_rows(packed, state)

    def encode_deferred(self, x: torch.Tensor, state: dict) -> Deferred:
        if self.config.nonfinite == "raise" or x.dtype == torch.float64:
            return Deferred(self.encode(x))
        if self.fuses(x, state):
            return self._encode_fused(x)
        group, x2d, rn, stats = self._prepare(x)
        k = min(state.get("rows", 0), x2d.shape[0]) if rn is not None and self.splits_rows else 0
        if not k:
            q = self._quantize(x, group, rounding_args(self))
            return Deferred(self._packed(x, q, group, None), *verdict(stats, q, self.max_range))
        zeroed, rows, rest, count = deferred_rows(x2d, rn, stats, self.max_range, k)
        q = self._quantize(zeroed.view(x.shape), group, rounding_args(self))
        parts, explain = verdict(rest, q, self.max_range)
        explain = rows_explain(state, explain, self.max_range, x2d.shape[0], rest.numel())
        return Deferred(self._packed(x, q, group, rows), [count.view(1), *parts], explain)

    def fuses(self, x: torch.Tensor, state: dict) -> bool:
        """Does a deferred encode of ``x`` take the fused Triton path (``ops.quant_stats``: the
        codes and the verdict's statistics in two launches)? On the Triton path, with a range
        check and no row split (the site's capacity of massive rows is 0)."""
        return (
            self.max_range is not None
            and x.numel() > 0
            and not (self.splits_rows and state.get("rows", 0))
            and use_triton(x, self.config.backend)
            and device_path.fused_codecs()
        )

    def _encode_fused(self, x: torch.Tensor) -> Deferred:
        """:meth:`encode_deferred` without a row split, in two kernels (``ops.quant_stats``):
        the same payload, and the same statistics in one tensor."""
        check_input(self, x)
        c = self.config
        width = x.shape[-1] if x.dim() else 1
        group = row_group(c.group_size, x.shape[-1] if x.dim() else 0)
        q, stats = quantize_with_stats_triton(
            x, width, bits=c.bits, group_size=group, symmetric=c.symmetric,
            paper_scale=c.paper_scale, **rounding_args(self),
        )  # fmt: skip
        n = stats_layout(x.numel() // width, c.symmetric)[2]
        return Deferred(
            self._packed(x, q, group, None), [stats], explainer(n, True, self.max_range)
        )

    def decode(self, packed: Packed) -> torch.Tensor:
        if (y := exact_value(packed)) is not None:
            return y
        y = dequantize(quantized_from(packed), dtype=packed.dtype, backend=self.config.backend)
        restore_rows(y.view(-1, packed.shape[-1] if packed.shape else 1), packed)
        return y.view(packed.shape)


@dataclass(frozen=True)
class ChannelQuantConfig(CodecConfig):
    """Channel-wise symmetric quantization: one scale per column of the [-1, channels] view.

    ``channels=0`` uses the tensor's last dimension.
    """

    bits: int = 4
    channels: int = 0
    paper_scale: bool = False
    nonfinite: str = "exact"
    backend: str = "auto"
    max_range: float | None = DEFAULT_MAX_RANGE
    rounding: str = "nearest"  # or "stochastic" (module docstring)

    def __post_init__(self) -> None:
        check_common(self, self.bits, self.nonfinite, self.backend, self.rounding)
        check_max_range(self, self.max_range)
        if not isinstance(self.channels, int) or self.channels < 0:
            raise ValueError(
                f"ChannelQuantConfig.channels must be an int >= 0, got {self.channels!r}"
            )


def channel_view(codec: Codec, x: torch.Tensor, channels: int) -> torch.Tensor:
    """``x`` in memory order as [rows, C] (C = ``channels`` or the last dimension)."""
    c = channels or (x.shape[-1] if x.dim() else 1)
    if c == 0 or x.numel() % c:
        raise ValueError(
            f"codec {codec_name(codec.config)!r}: channels={c} does not divide the "
            f"{x.numel()} values of a tensor of shape {tuple(x.shape)}"
        )
    return x.contiguous().view(-1, c)


def rows_view(codec: Codec, x: torch.Tensor, channels: int) -> torch.Tensor:
    """:func:`channel_view`, with an empty tensor as [0, 1] (the row-wise codecs' input)."""
    return x.reshape(0, 1) if x.numel() == 0 else channel_view(codec, x, channels)


class ChannelQuantCodec(Codec):
    config: ChannelQuantConfig

    def _quantize(self, x: torch.Tensor):
        """(x2d, row stats, Quantized, payload); x2d None for an empty tensor (nothing to
        check)."""
        check_input(self, x)
        c = self.config
        if x.numel() == 0:
            q = quantize(x, bits=c.bits, group_size=2, backend="ref")
            meta = {"numel": 0, "bits": c.bits, "group_size": 2}
            return None, None, q, Packed(quantized_payload(q), tuple(x.shape), x.dtype, x.device,
                                         meta)  # fmt: skip
        x2d = channel_view(self, x, c.channels)
        rows = row_stats(x2d, 0, c.max_range)
        q = quantize_channelwise(
            x2d, bits=c.bits, paper_scale=c.paper_scale, backend=c.backend, **rounding_args(self)
        )
        refuse_nonfinite(self, x, q.nonfinite, c.nonfinite)
        meta = {"numel": q.numel, "bits": c.bits, "group_size": 0, "channels": q.channels}
        return x2d, rows, q, Packed(quantized_payload(q), tuple(x.shape), x.dtype, x.device, meta)

    def encode(self, x: torch.Tensor) -> Packed:
        if (exact := self.float64_exact(x)) is not None:
            return exact
        x2d, rows, q, packed = self._quantize(x)
        if x2d is None:
            return packed
        reason = quantized_problem(x2d, 0, self.config.max_range, rows, q)
        return self.fallback(x, reason) if reason is not None else packed

    def encode_deferred(self, x: torch.Tensor, state: dict) -> Deferred:
        if self.config.nonfinite == "raise" or x.dtype == torch.float64:
            return Deferred(self.encode(x))
        c = self.config
        fused = use_triton(x, c.backend) and device_path.fused_codecs()
        if c.max_range is not None and x.numel() and fused:
            check_input(self, x)  # the Triton path: three launches (ops.quant_stats)
            x2d = channel_view(self, x, c.channels)
            q, stats = quantize_channelwise_with_stats_triton(
                x2d, bits=c.bits, paper_scale=c.paper_scale, **rounding_args(self)
            )
            meta = {"numel": q.numel, "bits": c.bits, "group_size": 0, "channels": q.channels}
            packed = Packed(quantized_payload(q), tuple(x.shape), x.dtype, x.device, meta)
            n = stats_layout(x2d.shape[0], True)[2]
            return Deferred(packed, [stats], explainer(n, True, c.max_range))
        x2d, rows, q, packed = self._quantize(x)
        if x2d is None:
            return Deferred(packed)
        return Deferred(packed, *verdict(rows, q, self.config.max_range))

    def decode(self, packed: Packed) -> torch.Tensor:
        if (y := exact_value(packed)) is not None:
            return y
        y = dequantize(quantized_from(packed), dtype=packed.dtype, backend=self.config.backend)
        return y.view(packed.shape)


register_codec("int4", QuantConfig(), QuantCodec)
register_codec("int4-asym", QuantConfig(symmetric=False), QuantCodec)
register_codec("int8", QuantConfig(bits=8), QuantCodec)
register_codec("int8-asym", QuantConfig(bits=8, symmetric=False), QuantCodec)
register_codec("int4-channel", ChannelQuantConfig(), ChannelQuantCodec)
register_codec("int8-channel", ChannelQuantConfig(bits=8), ChannelQuantCodec)
