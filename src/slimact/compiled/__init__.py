"""Actions inside torch.compile: traced codecs (``codec``; byte packing in ``packing``, PRAC in
``prac``; where they may run in ``devices``), compiled blocks with a recompute
budget and a codec each (``blocks``), and their strategies (``strategies``)."""

from slimact.compiled.blocks import (
    BlockChoice,
    compile_block,
    compile_blocks_with,
    compiled_saved_tensors,
    forward_live_bytes,
    own_code,
)
from slimact.compiled.codec import (
    CODECS,
    LAYOUT,
    TRACE_CALLS,
    CompiledCodec,
    choose,
    codec_hooks,
    decode,
    decode_ref,
    encode,
    encode_ref,
    hook_pair,
    keeps_exact,
    memory_order,
    prac_ranks,
    resolve_codec,
    saved_node,
)
from slimact.compiled.devices import (
    CUDA_OPT_IN,
    UnverifiedOnDevice,
    check_device,
    usable_codecs,
    usable_on,
)
from slimact.compiled.packing import pack_bits, pack_codes, unpack_bits, unpack_codes
from slimact.compiled.prac import TracedPrac, decode_prac, encode_prac, feeds_linear
from slimact.compiled.strategies import PRESETS, CompiledCodecConfig

__all__ = [
    "LAYOUT",
    "memory_order",
    "CODECS",
    "CUDA_OPT_IN",
    "UnverifiedOnDevice",
    "check_device",
    "usable_codecs",
    "usable_on",
    "TRACE_CALLS",
    "BlockChoice",
    "CompiledCodec",
    "CompiledCodecConfig",
    "PRESETS",
    "choose",
    "codec_hooks",
    "compile_block",
    "compile_blocks_with",
    "compiled_saved_tensors",
    "decode",
    "decode_ref",
    "encode",
    "encode_ref",
    "forward_live_bytes",
    "hook_pair",
    "own_code",
    "keeps_exact",
    "pack_bits",
    "pack_codes",
    "prac_ranks",
    "TracedPrac",
    "decode_prac",
    "encode_prac",
    "feeds_linear",
    "unpack_bits",
    "resolve_codec",
    "saved_node",
    "unpack_codes",
]
