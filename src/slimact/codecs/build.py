"""``build_codec(name, t)``: the registered codec ``name``, sized for the tensor it will store.

Per-channel codecs (``int8-channel``, ``int4-channel``, ``int4-outlier``) need the tensor's
hidden channel count (``slimact.classify.hidden_channels``: ``H*Dh`` for a [B, S, H, Dh]-laid
tensor); every other codec is returned as registered.
"""

from __future__ import annotations

import dataclasses

import torch

from slimact.classify import hidden_channels
from slimact.codecs.base import Codec, get_codec


def build_codec(name: str, t: torch.Tensor) -> Codec:
    """Codec ``name`` for tensor ``t``: ``channels`` fields get ``t``'s hidden channel count."""
    codec = get_codec(name)
    cfg = codec.config
    if "channels" in {f.name for f in dataclasses.fields(cfg)} and t.dim() > 0:
        codec = dataclasses.replace(cfg, channels=hidden_channels(t)).build()
    return codec
