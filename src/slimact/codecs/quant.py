"""Per-group INT4/INT8 codecs and channel-wise symmetric INT4 (adacc.txt §3.2, Eqs. 2-3).

``int4`` / ``int8`` quantize a saved tensor in memory order, ``group_size`` values per fp32
scale (symmetric, Eq. 2); ``int4-asym`` adds an fp32 offset per group (Eq. 3) for one-sided data
such as softmax probabilities. ``int4-channel`` is the Q/K/V scheme: one symmetric scale per
channel (a column of the ``[rows, channels]`` memory view), no transpose. Math, packing and error
bound (``|x - x^| <= S/2`` per group with the default divisors) are in ``slimact.ops.quant``.

Cost per element of an fp32 tensor (4 bytes): INT4 with groups of 128 stores 0.5 + 4/128 bytes
(7.5x smaller), ``int4-asym`` 0.5 + 8/128, INT8 1 + 4/128; encode is one read and one small
write, decode one small read and one write, against a recomputation that re-runs the op.

Non-finite values (NaN, ±inf) never become finite garbage. With ``nonfinite="exact"`` (the
default) they are excluded from the scales, and their flat positions and original values are
stored beside the codes (a sparse exact path) and written back on decode. With
``nonfinite="raise"`` the encode fails, and ``CodecPolicy`` adds the site name to the error.
Detecting them costs nothing extra on the ref path and one small device-to-host read (a sync) on
CUDA. Non-float tensors are rejected with a ``TypeError``; the ``int4`` strategy never sends them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimact.codecs.base import Codec, CodecConfig, Packed, codec_name, register_codec
from slimact.ops.quant import BACKENDS, Quantized, dequantize, quantize, quantize_channelwise

NONFINITE_MODES = ("exact", "raise")


def check_common(cfg: CodecConfig, bits: int, nonfinite: str, backend: str) -> None:
    name = type(cfg).__name__
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


def nonfinite_payload(
    codec: Codec, x: torch.Tensor, counts: torch.Tensor, mode: str
) -> dict[str, torch.Tensor]:
    """Exact positions and values of NaN/inf in ``x`` (empty dict when there are none)."""
    if counts.numel() == 0 or not bool(counts.any()):
        return {}
    flat = x.reshape(-1)
    idx = (~torch.isfinite(flat)).nonzero().view(-1)
    if mode == "raise":
        raise ValueError(
            f"codec {codec_name(codec.config)!r}: {idx.numel()} non-finite value(s) (NaN/inf) in "
            f"a tensor of shape {tuple(x.shape)}; nonfinite='raise' (use 'exact' to keep them)"
        )
    return {"nf_idx": idx, "nf_val": flat[idx].clone()}


def restore_nonfinite(y_flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    if "nf_idx" in tensors:
        y_flat[tensors["nf_idx"]] = tensors["nf_val"].to(y_flat.dtype)
    return y_flat


def quantized_from(packed: Packed) -> Quantized:
    t, m = packed.tensors, packed.meta
    return Quantized(
        t["codes"], t["scale"], t.get("offset"), t["scale"].new_zeros(0, dtype=torch.int32),
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

    def __post_init__(self) -> None:
        check_common(self, self.bits, self.nonfinite, self.backend)
        check_group_size(self, self.group_size)


class QuantCodec(Codec):
    config: QuantConfig

    def encode(self, x: torch.Tensor) -> Packed:
        check_input(self, x)
        c = self.config
        q = quantize(
            x, bits=c.bits, group_size=c.group_size, symmetric=c.symmetric,
            paper_scale=c.paper_scale, backend=c.backend,
        )  # fmt: skip
        tensors = quantized_payload(q)
        tensors.update(nonfinite_payload(self, x, q.nonfinite, c.nonfinite))
        meta = {"numel": q.numel, "bits": c.bits, "group_size": c.group_size}
        return Packed(tensors, tuple(x.shape), x.dtype, x.device, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        y = dequantize(quantized_from(packed), dtype=packed.dtype, backend=self.config.backend)
        return restore_nonfinite(y, packed.tensors).view(packed.shape)


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

    def __post_init__(self) -> None:
        check_common(self, self.bits, self.nonfinite, self.backend)
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


class ChannelQuantCodec(Codec):
    config: ChannelQuantConfig

    def encode(self, x: torch.Tensor) -> Packed:
        check_input(self, x)
        c = self.config
        if x.numel() == 0:
            q = quantize(x, bits=c.bits, group_size=2, backend="ref")
            meta = {"numel": 0, "bits": c.bits, "group_size": 2}
            return Packed(quantized_payload(q), tuple(x.shape), x.dtype, x.device, meta)
        x2d = channel_view(self, x, c.channels)
        q = quantize_channelwise(x2d, bits=c.bits, paper_scale=c.paper_scale, backend=c.backend)
        tensors = quantized_payload(q)
        tensors.update(nonfinite_payload(self, x, q.nonfinite, c.nonfinite))
        meta = {"numel": q.numel, "bits": c.bits, "group_size": 0, "channels": q.channels}
        return Packed(tensors, tuple(x.shape), x.dtype, x.device, meta)

    def decode(self, packed: Packed) -> torch.Tensor:
        y = dequantize(quantized_from(packed), dtype=packed.dtype, backend=self.config.backend)
        return restore_nonfinite(y, packed.tensors).view(packed.shape)


register_codec("int4", QuantConfig(), QuantCodec)
register_codec("int4-asym", QuantConfig(symmetric=False), QuantCodec)
register_codec("int8", QuantConfig(bits=8), QuantCodec)
register_codec("int8-asym", QuantConfig(bits=8, symmetric=False), QuantCodec)
register_codec("int4-channel", ChannelQuantConfig(), ChannelQuantCodec)
register_codec("int8-channel", ChannelQuantConfig(bits=8), ChannelQuantCodec)
