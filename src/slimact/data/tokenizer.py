"""Byte-level tokenizer: ids 0-255 are the bytes of the UTF-8 text, id 256 is end-of-document.

Why bytes and not BPE: nothing has to be trained or downloaded (slimact runs offline), the
mapping is fixed and deterministic across machines and versions, every input (any encoding, even
invalid UTF-8) is representable, and ``decode(encode(text)) == text`` holds exactly. The price is
longer sequences (about 3-4x a BPE tokenizer on code), which is acceptable for activation-memory
experiments: the models only need a realistic next-token task, not the best bits-per-byte.
Ids fit in ``uint16``, which is what the on-disk token cache stores.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    """ids 0-255 = bytes, ``eos_id`` = 256; ``vocab_size`` = 257."""

    name = "byte-v1"
    eos_id = 256

    @property
    def vocab_size(self) -> int:
        return 257

    def encode_bytes(self, data: bytes, *, add_eos: bool = False) -> np.ndarray:
        """Token ids (``uint16``) of raw bytes, optionally followed by EOS."""
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        if add_eos:
            ids = np.append(ids, np.uint16(self.eos_id))
        return ids

    def encode(self, text: str, *, add_eos: bool = False) -> np.ndarray:
        """Token ids (``uint16``) of the UTF-8 encoding of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}; use encode_bytes")
        return self.encode_bytes(text.encode("utf-8"), add_eos=add_eos)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Bytes of the ids; EOS ids become nothing. Rejects ids outside [0, 256]."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > self.eos_id):
            bad = int(arr[(arr < 0) | (arr > self.eos_id)][0])
            raise ValueError(f"token id {bad} is outside the byte vocabulary [0, {self.eos_id}]")
        return arr[arr != self.eos_id].astype(np.uint8).tobytes()

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids (EOS dropped; invalid UTF-8 becomes U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"
