"""Data pipeline: tokenizer, stdlib corpus, token cache, user data and its errors, loaders."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slimact.data import (
    BatchLoader,
    ByteTokenizer,
    cache_path,
    fixed_batches,
    is_validation,
    iter_documents,
    load_data,
    stdlib_corpus,
    user_corpus,
)
from slimact.data import cache as cache_mod

TOK = ByteTokenizer()


@pytest.fixture(autouse=True)
def _cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMACT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def stdlib_splits(tmp_path_factory):
    return load_data(None, cache=tmp_path_factory.mktemp("stdlib-cache"))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --- tokenizer ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert ids.dtype == np.uint16
    assert TOK.decode(ids) == text
    assert TOK.decode(TOK.encode(text, add_eos=True)) == text


def test_tokenizer_ids():
    assert TOK.vocab_size == 257 and TOK.eos_id == 256
    assert TOK.encode("Aé").tolist() == [65, 0xC3, 0xA9]
    assert TOK.encode_bytes(b"\xff\x00", add_eos=True).tolist() == [255, 0, 256]
    assert TOK.decode([104, 256, 105]) == "hi"
    with pytest.raises(ValueError, match="257"):
        TOK.decode([257])
    with pytest.raises(TypeError):
        TOK.encode(b"bytes")


# --- stdlib corpus -----------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_and_clean():
    a, b = stdlib_corpus(), stdlib_corpus()
    rels = [f.rel for f in a.files]
    assert rels == [f.rel for f in b.files] == sorted(rels)
    assert len(rels) > 100
    assert "os.py" in rels and "json/decoder.py" in rels
    for rel in rels:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(parts)
        assert not parts[-1].startswith("test_") and not parts[-1].endswith("_test.py")


def test_validation_split_is_stable_and_disjoint():
    rels = [f.rel for f in stdlib_corpus().files]
    val = {r for r in rels if is_validation(r)}
    train = set(rels) - val
    assert val and train and not (val & train)
    assert 0.01 < len(val) / len(rels) < 0.12
    assert val == {r for r in rels if is_validation(r)}
    # The hash is BLAKE2b, not Python's salted hash(): fixed answers for fixed keys.
    assert [is_validation(k) for k in ("os.py", "json/decoder.py")] == [False, False]
    assert sum(is_validation(f"doc-{i}") for i in range(10000)) in range(400, 600)


def test_stdlib_splits_follow_the_file_split(stdlib_splits):
    corpus = stdlib_corpus()
    val_bytes = sum(len(d) + 1 for k, d in iter_documents(corpus) if is_validation(k))
    all_bytes = sum(len(d) + 1 for _, d in iter_documents(corpus))
    assert stdlib_splits.val.size == val_bytes
    assert stdlib_splits.num_tokens == all_bytes
    assert stdlib_splits.train[-1] == TOK.eos_id == stdlib_splits.val[-1]
    assert int(stdlib_splits.train.max()) <= 256


# --- cache -------------------------------------------------------------------------------------


def test_cache_is_reused_and_memory_mapped(tmp_path, monkeypatch):
    src = write(tmp_path / "a.txt", "hello world\n" * 200)
    first = load_data(src)
    assert isinstance(first.train, np.memmap) and first.path is not None
    assert first.path.parent == tmp_path / "cache"

    def boom(*a, **k):
        raise AssertionError("cache should have been reused")

    monkeypatch.setattr(cache_mod, "tokenize_corpus", boom)
    second = load_data(src)
    assert second.path == first.path
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_cache_key_follows_file_changes(tmp_path):
    src = write(tmp_path / "a.txt", "one two three\n" * 50)
    p1 = load_data(src).path
    write(src, "four five six seven\n" * 50)
    os.utime(src, ns=(1, 1))
    splits = load_data(src)
    assert splits.path != p1
    assert TOK.decode(np.concatenate([splits.train, splits.val]))[:4] == "four"


@pytest.mark.parametrize("damage", ["truncate", "magic", "counts", "tail"])
def test_corrupt_cache_is_rebuilt_with_warning(tmp_path, damage):
    src = write(tmp_path / "a.txt", "some text for the cache\n" * 100)
    good = load_data(src)
    path, train, val = good.path, np.array(good.train), np.array(good.val)
    del good
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-7]
    elif damage == "magic":
        raw[:8] = b"GARBAGE!"
    elif damage == "counts":
        struct.pack_into("<Q", raw, 16, 3)
    else:
        raw[-2:] = b"\x41\x00"
    path.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="corrupt"):
        rebuilt = load_data(src)
    assert np.array_equal(rebuilt.train, train) and np.array_equal(rebuilt.val, val)
    assert path.stat().st_size == cache_mod.HEADER_BYTES + 2 * (train.size + val.size)


def test_cache_path_depends_on_tokenizer_and_python(tmp_path, monkeypatch):
    corpus = user_corpus(write(tmp_path / "a.txt", "x" * 100))
    p1 = cache_path(corpus, TOK)
    monkeypatch.setattr(cache_mod.sys, "version", "0.0.0 (other)")
    assert cache_path(corpus, TOK) != p1


# --- user data ---------------------------------------------------------------------------------


def test_user_txt_and_jsonl(tmp_path):
    txt = write(tmp_path / "d" / "a.txt", "plain text file\n")
    lines = [json.dumps({"text": f"record {i}", "id": i}) for i in range(40)]
    jsonl = write(
        tmp_path / "d" / "sub" / "b.jsonl", "\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:])
    )
    write(tmp_path / "d" / "ignored.md", "not used")
    corpus = user_corpus(tmp_path / "d")
    assert [f.rel for f in corpus.files] == ["a.txt", "sub/b.jsonl"]
    docs = list(iter_documents(corpus))
    assert docs[0] == ("a.txt", b"plain text file\n")
    assert docs[1] == ("sub/b.jsonl:1", b"record 0") and len(docs) == 41
    assert docs[-1][0] == "sub/b.jsonl:41"  # blank line 21 is skipped but counted
    splits = load_data(tmp_path / "d")
    text = TOK.decode_bytes(np.concatenate([splits.train, splits.val]))
    assert b"record 39" in text and b"plain text file" in text
    assert load_data(jsonl).num_tokens == sum(len(f"record {i}") + 1 for i in range(40))
    assert load_data(txt).num_tokens == len("plain text file\n") + 2  # + EOS, + split EOS


def test_single_document_gets_a_tail_validation_split(tmp_path):
    splits = load_data(write(tmp_path / "one.txt", "abcdefghij" * 100))
    assert splits.train.size > 0 and splits.val.size > 0
    assert splits.val.size == pytest.approx(0.05 * 1001, abs=2)
    assert TOK.decode(splits.train) + TOK.decode(splits.val) == "abcdefghij" * 100


def test_bad_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_data(tmp_path / "nope.txt")
    empty = write(tmp_path / "empty.txt", "")
    with pytest.raises(ValueError, match="empty.txt.*empty"):
        load_data(empty)
    bad = write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: line is not valid JSON"):
        load_data(bad)
    no_text = write(tmp_path / "nt.jsonl", '{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r'nt\.jsonl:2: record has no "text"'):
        load_data(no_text)
    not_str = write(tmp_path / "ns.jsonl", '{"text": 3}\n')
    with pytest.raises(ValueError, match=r"ns\.jsonl:1: \"text\" must be a string"):
        load_data(not_str)
    (tmp_path / "emptydir").mkdir()
    write(tmp_path / "emptydir" / "x.csv", "a,b")
    write(tmp_path / "emptydir" / "zero.txt", "")
    with pytest.raises(ValueError, match="emptydir has no usable files"):
        load_data(tmp_path / "emptydir")
    with pytest.raises(ValueError, match=r"suffix '\.csv'"):
        load_data(tmp_path / "emptydir" / "x.csv")


# --- loaders -----------------------------------------------------------------------------------


def test_loader_is_deterministic_and_shifted(stdlib_splits):
    a = BatchLoader(stdlib_splits.train, batch=4, seq=32, seed=7)
    b = BatchLoader(stdlib_splits.train, batch=4, seq=32, seed=7)
    c = BatchLoader(stdlib_splits.train, batch=4, seq=32, seed=8)
    for _ in range(5):
        (xa, ya), (xb, yb), (xc, _) = a.next_batch(), b.next_batch(), c.next_batch()
        assert xa.shape == ya.shape == (4, 32) and xa.dtype == ya.dtype == torch.long
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])


def test_loader_state_restores_the_batch_sequence():
    tokens = np.arange(1000, dtype=np.uint16) % 257
    ref = BatchLoader(tokens, batch=3, seq=16, seed=1)
    for _ in range(25):  # crosses epoch boundaries (62 windows per epoch)
        ref.next_batch()
    state = ref.state_dict()
    assert all(isinstance(v, int) for v in state.values())
    expected = [ref.next_batch() for _ in range(30)]
    other = BatchLoader(tokens, batch=3, seq=16, seed=1)
    other.load_state_dict(state)
    for (x, y), (ex, ey) in zip([other.next_batch() for _ in range(30)], expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(ValueError, match="seq=16"):
        BatchLoader(tokens, batch=3, seq=8, seed=1).load_state_dict(state)


def test_loader_epoch_covers_each_window_once():
    tokens = np.arange(401, dtype=np.uint16)
    loader = BatchLoader(tokens, batch=5, seq=10, seed=3)
    n = loader.windows_per_epoch
    starts = [int(x[0]) for _ in range(n // 5) for x in loader.next_batch()[0]]
    assert len(set(starts)) == len(starts) == (n // 5) * 5
    assert len({s % 10 for s in starts}) == 1  # one offset per epoch


def test_tiny_data_wraps_and_short_split_errors():
    tokens = np.arange(20, dtype=np.uint16)
    loader = BatchLoader(tokens, batch=8, seq=9, seed=0)  # 2 windows per epoch, batch of 8
    x, y = loader.next_batch()
    assert x.shape == (8, 9)
    with pytest.raises(ValueError, match="fewer than seq \\+ 1 = 21"):
        BatchLoader(tokens, batch=1, seq=20)
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        BatchLoader(tokens, batch=0, seq=4)


def test_fixed_validation_batches(stdlib_splits):
    a = fixed_batches(stdlib_splits.val, batch=4, seq=64, num_batches=3)
    b = fixed_batches(stdlib_splits.val, batch=4, seq=64, num_batches=3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (4, 64) and torch.equal(xa, xb) and torch.equal(ya, yb)
    short = fixed_batches(np.arange(50, dtype=np.uint16), batch=4, seq=10, num_batches=5)
    assert [x.shape[0] for x, _ in short] == [4]
