"""Data pipeline: corpus → byte tokens → memory-mapped cache → deterministic (x, y) batches.

``load_data(None)`` gives the embedded stdlib corpus, ``load_data("notes.jsonl")`` a user's data;
both return ``TokenSplits`` (train/val ``uint16`` streams). ``BatchLoader`` draws resumable random
training batches from a stream and ``fixed_batches`` the fixed validation set.
"""

from __future__ import annotations

from pathlib import Path

from slimact.data.cache import TokenSplits, cache_dir, cache_key, cache_path, load_token_splits
from slimact.data.corpus import (
    VAL_FRACTION,
    Corpus,
    SourceFile,
    is_validation,
    iter_documents,
    resolve_corpus,
    stdlib_corpus,
    user_corpus,
)
from slimact.data.loader import BatchLoader, fixed_batches
from slimact.data.tokenizer import ByteTokenizer


def load_data(
    data: str | Path | None = None,
    tokenizer: ByteTokenizer | None = None,
    cache: str | Path | None = None,
) -> TokenSplits:
    """Token splits of ``data`` (``None`` = stdlib corpus), cached under ``cache`` or the default."""
    return load_token_splits(resolve_corpus(data), tokenizer or ByteTokenizer(), cache)


__all__ = [
    "VAL_FRACTION",
    "BatchLoader",
    "ByteTokenizer",
    "Corpus",
    "SourceFile",
    "TokenSplits",
    "cache_dir",
    "cache_key",
    "cache_path",
    "fixed_batches",
    "is_validation",
    "iter_documents",
    "load_data",
    "load_token_splits",
    "resolve_corpus",
    "stdlib_corpus",
    "user_corpus",
]
