"""Per-token INT4: adacc.txt §3.2's naive baseline (Fig. 3b(i)), one scale per token.

"A straightforward approach is to compress activations from FP16 to INT4 using per-token
quantization": every row of the ``[tokens, C]`` memory view (``C = channels``, or the last
dimension) gets one fp32 symmetric scale ``S = max|row| / 8`` with the paper's divisor, and every
value becomes ``clip(round(x / S), -8, 7)`` (Eq. 2), outliers included. This is what the paper's
evaluation calls *Quantization* and reports as diverging (§4.2-4.3); the ``int4-naive`` strategy
stores every floating-point activation through it.

It is a baseline, not a candidate: registered as ``int4-token`` / ``int8-token`` with
``candidate=False`` (plans and labels name it, ``codec_names()`` and so the planner's profiles
leave it out), and it runs the plain-PyTorch path (``slimact.ops.quant.quantize_ref``: a row is a
group of ``C`` values, any ``C``) on every device. Bytes: ``ceil(n/2)`` for the codes plus 4 per
token.

The project's rules hold as in ``slimact.codecs.quant``: NaN/inf are kept exactly, in band
(``slimact.ops.quant``), a deferred encode reads nothing on the host, and a tensor whose range the fp32 arithmetic cannot represent faithfully (squares that
overflow float32, a row more than ``max_range`` times the median row) is stored exactly
(``Codec.fallback``, reported per site by the saving policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimact.codecs.base import (
    Codec,
    CodecConfig,
    Deferred,
    Packed,
    exact_value,
    register_codec,
)
from slimact.codecs.quant import (
    DEFAULT_MAX_RANGE,
    check_common,
    check_input,
    check_max_range,
    quantized_from,
    quantized_payload,
    quantized_problem,
    refuse_nonfinite,
    rounding_args,
    rows_view,
    verdict,
)
from slimact.codecs.rows import (
    row_stats,
)
from slimact.ops.quant import dequantize_ref, quantize_ref


@dataclass(frozen=True)
class TokenQuantConfig(CodecConfig):
    """One symmetric scale per row of the ``[-1, channels]`` view (``channels=0``: last dim)."""

    bits: int = 4
    channels: int = 0
    paper_scale: bool = True  # adacc.txt's S = max|x| / 8 (INT4)
    nonfinite: str = "exact"
    max_range: float | None = DEFAULT_MAX_RANGE
    rounding: str = "nearest"  # or "stochastic" (slimact.codecs.quant; the clipped max excepted)

    def __post_init__(self) -> None:
        check_common(self, self.bits, self.nonfinite, "ref", self.rounding)
        check_max_range(self, self.max_range)
        if not isinstance(self.channels, int) or self.channels < 0:
            raise ValueError(
                f"TokenQuantConfig.channels must be an int >= 0, got {self.channels!r}"
            )
        if not isinstance(self.paper_scale, bool):
            raise ValueError(
                f"TokenQuantConfig.paper_scale must be a bool, got {self.paper_scale!r}"
            )


class TokenQuantCodec(Codec):
    config: TokenQuantConfig

    def _quantize(self, x: torch.Tensor):
        check_input(self, x)
        c = self.config
        x2d = rows_view(self, x, c.channels)
        width = max(1, x2d.shape[1])
        rows = row_stats(x2d, 0, c.max_range)
        q = quantize_ref(x2d, c.bits, width, True, c.paper_scale, **rounding_args(self))
        refuse_nonfinite(self, x, q.nonfinite, c.nonfinite)
        meta = {"numel": q.numel, "bits": c.bits, "group_size": width}
        return x2d, rows, q, Packed(quantized_payload(q), tuple(x.shape), x.dtype, x.device, meta)

    def encode(self, x: torch.Tensor) -> Packed:
        if (exact := self.float64_exact(x)) is not None:
            return exact
        x2d, rows, q, packed = self._quantize(x)
        reason = quantized_problem(x2d, 0, self.config.max_range, rows, q)
        return self.fallback(x, reason) if reason is not None else packed

    def encode_deferred(self, x: torch.Tensor, state: dict) -> Deferred:
        if self.config.nonfinite == "raise" or x.dtype == torch.float64:
            return Deferred(self.encode(x))
        _, rows, q, packed = self._quantize(x)
        return Deferred(packed, *verdict(rows, q, self.config.max_range))

    def decode(self, packed: Packed) -> torch.Tensor:
        if (y := exact_value(packed)) is not None:
            return y
        return dequantize_ref(quantized_from(packed), dtype=packed.dtype).view(packed.shape)


# baselines (see the module docstring): labels name them (``codec:int4-token``), the planner not
register_codec("int4-token", TokenQuantConfig(), TokenQuantCodec, candidate=False)
register_codec("int8-token", TokenQuantConfig(bits=8), TokenQuantCodec, candidate=False)
