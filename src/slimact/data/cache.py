"""On-disk token cache: one memory-mapped ``uint16`` file per (corpus, tokenizer) pair.

Layout: a 64-byte header (magic, format version, vocab size, train and val token counts, the
32-byte key digest) followed by the train tokens and then the val tokens. The key is a SHA-256 of
the corpus file list with sizes and mtimes, the tokenizer name, the Python version and the split
rule, so editing a file or switching interpreters builds a new cache. Files are written to a
temporary name in the cache directory and moved into place with ``os.replace``, so a crash never
leaves a half-written cache under the real name. On load the header, key, counts and file size are
checked and both splits must end with EOS; anything off is reported with a warning and rebuilt.
The directory is ``$SLIMACT_CACHE`` or ``~/.cache/slimact``; if it is not writable the tokens are
kept in memory (with a warning) and training still works.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from slimact.data.corpus import VAL_FRACTION, Corpus, is_validation, iter_documents
from slimact.data.tokenizer import ByteTokenizer

MAGIC = b"SLIMTOK\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQ32s")
HEADER_BYTES = 64
_DTYPE = np.dtype("<u2")


@dataclass(frozen=True)
class TokenSplits:
    """Train and validation token streams (``uint16``, documents separated by EOS)."""

    train: np.ndarray
    val: np.ndarray
    path: Path | None
    key: str

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            arr = getattr(self, split)
            if arr.ndim != 1 or arr.dtype != _DTYPE:
                raise ValueError(f"{split} tokens must be a 1-D uint16 array, got {arr.dtype}")

    @property
    def num_tokens(self) -> int:
        return int(self.train.size + self.val.size)


def cache_dir() -> Path:
    """``$SLIMACT_CACHE`` if set, else ``~/.cache/slimact``."""
    env = os.environ.get("SLIMACT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "slimact"


def cache_key(corpus: Corpus, tokenizer: ByteTokenizer) -> str:
    payload = {
        "format": FORMAT_VERSION,
        "corpus": corpus.name,
        "files": corpus.fingerprint(),
        "tokenizer": tokenizer.name,
        "python": sys.version,
        "split": ["blake2b-per-document", VAL_FRACTION],
    }
    blob = json.dumps(payload, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def cache_path(corpus: Corpus, tokenizer: ByteTokenizer, directory: Path | None = None) -> Path:
    key = cache_key(corpus, tokenizer)
    return (directory or cache_dir()) / f"{corpus.name}-{tokenizer.name}-{key[:20]}.tokens"


def tokenize_corpus(corpus: Corpus, tokenizer: ByteTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize every document (each followed by EOS) into train and val streams.

    Documents are assigned by ``is_validation``. If that leaves either side empty (a corpus of
    one or a handful of documents), the concatenated stream is split instead: its last
    ``VAL_FRACTION`` of tokens becomes validation.
    """
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    docs = tqdm(
        iter_documents(corpus),
        total=len(corpus.files),
        desc="tokenizing corpus (once; cached)",
        unit="file",
        delay=2.0,  # shown only when it takes a while
        leave=False,
    )
    for key, data in docs:
        parts[is_validation(key)].append(tokenizer.encode_bytes(data, add_eos=True))
    if not parts[False] and not parts[True]:
        raise ValueError(f"--data {corpus.root} holds no text")
    if parts[False] and parts[True]:
        return np.concatenate(parts[False]), np.concatenate(parts[True])
    stream = np.concatenate(parts[False] or parts[True])
    cut = max(1, min(stream.size - 1, round(stream.size * (1 - VAL_FRACTION))))
    # The document that straddles the cut becomes two: the train part gets its own EOS.
    return np.append(stream[:cut], np.uint16(tokenizer.eos_id)), stream[cut:].copy()


def _check(path: Path, key: str, vocab_size: int) -> tuple[int, int] | str:
    """(n_train, n_val) if the file at ``path`` is a valid cache for ``key``, else why not."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        return f"file is {size} bytes, shorter than the {HEADER_BYTES}-byte header"
    with path.open("rb") as fh:
        header = fh.read(HEADER_BYTES)
    magic, version, vocab, n_train, n_val, digest = _HEADER.unpack_from(header)
    if magic != MAGIC or version != FORMAT_VERSION:
        return f"bad header (magic {magic!r}, version {version})"
    if digest != bytes.fromhex(key) or vocab != vocab_size:
        return "header does not match this corpus/tokenizer"
    expected = HEADER_BYTES + _DTYPE.itemsize * (n_train + n_val)
    if size != expected or n_train == 0 or n_val == 0:
        return f"file is {size} bytes, header says {expected} ({n_train} + {n_val} tokens)"
    return int(n_train), int(n_val)


def _open(path: Path, n_train: int, n_val: int) -> tuple[np.ndarray, np.ndarray]:
    mm = np.memmap(path, dtype=_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n_train + n_val,))
    return mm[:n_train], mm[n_train:]


def _write(path: Path, key: str, vocab_size: int, train: np.ndarray, val: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, vocab_size, train.size, val.size, bytes.fromhex(key)
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(header.ljust(HEADER_BYTES, b"\x00"))
            fh.write(train.astype(_DTYPE, copy=False).tobytes())
            fh.write(val.astype(_DTYPE, copy=False).tobytes())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_token_splits(
    corpus: Corpus, tokenizer: ByteTokenizer | None = None, directory: str | Path | None = None
) -> TokenSplits:
    """Memory-mapped train/val tokens of ``corpus``, building (or rebuilding) the cache if needed."""
    tokenizer = tokenizer or ByteTokenizer()
    if tokenizer.vocab_size > np.iinfo(_DTYPE).max + 1:
        raise ValueError(f"vocab_size {tokenizer.vocab_size} does not fit the uint16 token cache")
    key = cache_key(corpus, tokenizer)
    path = cache_path(corpus, tokenizer, Path(directory) if directory else None)
    if path.exists():
        found = _check(path, key, tokenizer.vocab_size)
        if isinstance(found, tuple):
            train, val = _open(path, *found)
            if train[-1] == tokenizer.eos_id and val[-1] == tokenizer.eos_id:
                return TokenSplits(train=train, val=val, path=path, key=key)
            found = "token streams do not end with EOS"
        warnings.warn(f"token cache {path} is corrupt ({found}); rebuilding it", stacklevel=2)
    train, val = tokenize_corpus(corpus, tokenizer)
    try:
        _write(path, key, tokenizer.vocab_size, train, val)
    except OSError as exc:
        warnings.warn(
            f"could not write token cache {path} ({exc}); keeping tokens in memory", stacklevel=2
        )
        return TokenSplits(train=train, val=val, path=None, key=key)
    train, val = _open(path, train.size, val.size)
    return TokenSplits(train=train, val=val, path=path, key=key)
