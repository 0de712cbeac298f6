"""The default corpus (``attnres_dist.data.stdlib_corpus``): built once from Python's standard
library, cached, rebuilt when its fingerprint changes (one builder at a time), and encoded by a
Hugging Face tokenizer under a prefix of its own."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from attnres_dist import data
from attnres_dist.data import indexed, stdlib_corpus
from attnres_dist.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.test_data import make_hf_tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    prefix = data.ensure_default_corpus(str(cache))
    return cache, prefix


def test_default_corpus_builds_and_is_cached(corpus, monkeypatch):
    cache, prefix = corpus
    meta = indexed.read_metadata(prefix)
    assert meta["source"] == "python-stdlib" and meta["tokenizer"] == "bytes"
    assert meta["splits"]["valid"]["docs"] >= 1 and meta["splits"]["train"]["docs"] > 100
    assert 1e6 < meta["splits"]["train"]["tokens"] < 60e6
    stamps = {f: os.stat(f).st_mtime_ns for f in indexed.dataset_files(prefix)}

    def no_rebuild(*args):
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr(stdlib_corpus, "build_corpus", no_rebuild)  # cached: not built again
    assert data.ensure_default_corpus(str(cache)) == prefix
    assert {f: os.stat(f).st_mtime_ns for f in indexed.dataset_files(prefix)} == stamps
    train, valid, _ = data.open_dataset(prefix, 128, 257, cache_dir=str(cache))
    assert len(valid) >= 1
    text = ByteTokenizer().decode(train.window(0))
    assert "import" in text or "def " in text or '"""' in text


def test_default_corpus_rebuilds_on_fingerprint_change_and_locks(tmp_path, monkeypatch):
    real_files = stdlib_corpus.stdlib_files
    monkeypatch.setattr(stdlib_corpus, "stdlib_files", lambda root: real_files(root)[:60])
    builds = []
    real_build = stdlib_corpus.build_corpus

    def counting_build(*args):
        builds.append(1)
        time.sleep(0.2)  # widen the race window
        return real_build(*args)

    monkeypatch.setattr(stdlib_corpus, "build_corpus", counting_build)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(data.ensure_default_corpus(str(tmp_path))))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and len(builds) == 1
    meta_file = indexed.meta_path(results[0])
    meta = json.loads(open(meta_file).read())
    meta["fingerprint"] = "stale"
    open(meta_file, "w").write(json.dumps(meta))
    data.ensure_default_corpus(str(tmp_path))
    assert len(builds) == 2
    assert indexed.read_metadata(results[0])["fingerprint"] != "stale"


def test_default_corpus_in_a_hugging_face_tokenizer(tmp_path, monkeypatch):
    """Under ``data.tokenizer: hf`` the corpus is the same files, each encoded as text by that
    tokenizer, under a prefix of its own (a 30-file standard library keeps it quick)."""
    root = stdlib_corpus.stdlib_root()
    files = stdlib_corpus.stdlib_files(root)[:30]
    monkeypatch.setattr(stdlib_corpus, "stdlib_files", lambda _: files)
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "tok.json"))
    prefix = data.ensure_default_corpus(str(tmp_path / "cache"), tok)
    assert prefix != stdlib_corpus.corpus_prefix(str(tmp_path / "cache"))  # not the bytes one
    meta = indexed.read_metadata(prefix)
    assert meta["tokenizer"] == "hf" and meta["vocab_size"] == tok.vocab_size
    valid = stdlib_corpus.valid_set([rel for rel, _ in files])
    expected = [
        # each document closed by the end-of-document token
        tok.encode(Path(root, rel).read_bytes().decode("utf-8", errors="replace")) + [tok.eod]
        for rel, _ in files
        if rel not in valid
    ]
    train = indexed.open_split(prefix, "train")
    assert [train[i].tolist() for i in range(len(train))] == expected
    assert data.ensure_default_corpus(str(tmp_path / "cache"), tok) == prefix  # cached
