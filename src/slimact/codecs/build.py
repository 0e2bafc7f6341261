"""``build_codec(label, t)``: the codec a label names, sized for the tensor it will store.

A label is a registered name with optional parameters (``int4-outlier/g32``, see
``slimact.codecs.base.codec_config``). Per-channel codecs (``int8-channel``, ``int4-channel``,
``int4-outlier``, ``int4-token``) need the tensor's hidden channel count
(``slimact.codecs.saving.hidden_channels``: ``H*Dh`` for a [B, S, H, Dh]-laid tensor), or the count a
caller gives; every other codec is built as the label says.
"""

from __future__ import annotations

import dataclasses

import torch

from slimact.codecs.base import Codec, codec_config
from slimact.codecs.saving import hidden_channels


def build_codec(label: str, t: torch.Tensor, channels: int | None = None) -> Codec:
    """Codec ``label`` for tensor ``t``: a ``channels`` field gets ``channels``, else (None)
    ``t``'s hidden channel count (a 0-d ``t``: the label's own)."""
    cfg = codec_config(label)
    if getattr(cfg, "inner", ""):  # a wrapper (offload+int8): its inner codec sized for ``t``
        codec = cfg.build()
        codec.inner = build_codec(cfg.inner, t, channels)
        return codec
    if "channels" in {f.name for f in dataclasses.fields(cfg)}:
        if channels is None and t.dim() > 0:
            channels = hidden_channels(t)
        if channels is not None:
            cfg = dataclasses.replace(cfg, channels=channels)
    return cfg.build()
