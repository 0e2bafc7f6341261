"""Where training text comes from: the embedded stdlib corpus or a user's .txt/.jsonl files.

The default corpus is the ``.py`` sources of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``): always present, no download, a few MB of real code. Third
party packages (``site-packages``/``dist-packages``) and every test file or directory are left
out. Files are listed in sorted relative-POSIX-path order so the token stream is the same on every
run. A user's ``--data`` is a ``.txt``/``.jsonl`` file or a directory of them (recursively); a
``.txt`` file is one document, each jsonl line is one document (its ``"text"`` field).

The validation split is chosen per document by a stable hash (BLAKE2b, not Python's salted
``hash``) of its key — the relative path for files, ``path:line`` for jsonl records — so about
``VAL_FRACTION`` of the documents are held out, independent of which other files exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VAL_FRACTION = 0.05
USER_SUFFIXES = (".txt", ".jsonl")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class SourceFile:
    """One input file: where it is, its key (relative POSIX path) and what identifies its content."""

    path: Path
    rel: str
    size: int
    mtime_ns: int

    @property
    def kind(self) -> str:
        return "jsonl" if self.path.suffix == ".jsonl" else "text"


@dataclass(frozen=True)
class Corpus:
    """An ordered list of source files plus a name (``stdlib`` or ``user``)."""

    name: str
    root: Path
    files: tuple[SourceFile, ...]

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError(f"corpus {self.name!r} at {self.root} has no files")

    def fingerprint(self) -> list[list[object]]:
        """What the token cache is keyed by: path, size and mtime of every file, in order."""
        return [[str(f.path), f.size, f.mtime_ns] for f in self.files]


def is_validation(key: str, fraction: float = VAL_FRACTION) -> bool:
    """Stable per-document split: True for about ``fraction`` of all keys."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def _source(path: Path, root: Path) -> SourceFile:
    st = path.stat()
    rel = path.relative_to(root).as_posix() if path != root else path.name
    return SourceFile(path=path, rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns)


def _is_test_file(name: str) -> bool:
    return name.startswith("test_") or name.endswith("_test.py")


def stdlib_corpus(stdlib: str | Path | None = None) -> Corpus:
    """The interpreter's stdlib ``.py`` sources, tests and third-party packages excluded."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"]).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} does not exist")
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py") and not _is_test_file(name):
                found.append(_source(Path(dirpath) / name, root))
    found.sort(key=lambda f: f.rel)
    return Corpus(name="stdlib", root=root, files=tuple(found))


def user_corpus(data: str | Path) -> Corpus:
    """A user's ``.txt``/``.jsonl`` file or a directory searched recursively for them."""
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--data path {str(data)!r} does not exist")
    path = path.resolve()
    if path.is_file():
        if path.suffix not in USER_SUFFIXES:
            raise ValueError(
                f"--data file {path} has suffix {path.suffix!r}; valid: {', '.join(USER_SUFFIXES)}"
            )
        return Corpus(name="user", root=path.parent, files=(_source(path, path.parent),))
    files = sorted(
        (_source(p, path) for p in path.rglob("*") if p.is_file() and p.suffix in USER_SUFFIXES),
        key=lambda f: f.rel,
    )
    usable = tuple(f for f in files if f.size > 0)
    if not usable:
        raise ValueError(
            f"--data directory {path} has no usable files (non-empty "
            f"{' or '.join(USER_SUFFIXES)} files, searched recursively)"
        )
    return Corpus(name="user", root=path, files=usable)


def resolve_corpus(data: str | Path | None) -> Corpus:
    """``None`` → the stdlib corpus; otherwise the user's file or directory."""
    return stdlib_corpus() if data is None else user_corpus(data)


def _jsonl_documents(src: SourceFile) -> Iterator[tuple[str, bytes]]:
    with src.path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{src.path}:{lineno}: line is not valid JSON ({exc})") from None
            if not isinstance(record, dict) or "text" not in record:
                got = (
                    f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
                )
                raise ValueError(
                    f'{src.path}:{lineno}: record has no "text" field (got {got}); each line '
                    'must be a JSON object such as {"text": "..."}'
                )
            text = record["text"]
            if not isinstance(text, str):
                raise ValueError(
                    f'{src.path}:{lineno}: "text" must be a string, got {type(text).__name__}'
                )
            if text:
                yield f"{src.rel}:{lineno}", text.encode("utf-8")


def iter_documents(corpus: Corpus) -> Iterator[tuple[str, bytes]]:
    """(split key, raw bytes) of every non-empty document, in corpus order.

    A user file that holds no text raises ``ValueError`` naming it; empty stdlib files (such as
    bare ``__init__.py``) are skipped silently.
    """
    for src in corpus.files:
        if src.kind == "jsonl":
            docs = list(_jsonl_documents(src))
            if not docs and corpus.name == "user":
                raise ValueError(f'--data file {src.path} has no non-empty "text" records')
            yield from docs
            continue
        data = src.path.read_bytes()
        if not data.strip():
            if corpus.name == "user":
                raise ValueError(f"--data file {src.path} is empty")
            continue
        yield src.rel, data
