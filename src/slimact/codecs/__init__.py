"""Codecs for saved tensors and the mechanism that stores sites through them."""

from slimact.codecs.base import (
    Codec,
    CodecConfig,
    Packed,
    codec_config,
    codec_label,
    codec_name,
    codec_names,
    get_codec,
    register_codec,
    storage_nbytes,
)
from slimact.codecs.saving import CodecPolicy, CodecStored

# Built-in codecs register themselves on import (get_codec("int4") works after importing this).
from slimact.codecs import bits, offload, outlier, quant, token  # noqa: E402, F401  isort: skip

__all__ = [
    "Codec",
    "CodecConfig",
    "CodecPolicy",
    "CodecStored",
    "Packed",
    "codec_config",
    "codec_label",
    "codec_name",
    "codec_names",
    "get_codec",
    "register_codec",
    "storage_nbytes",
]
