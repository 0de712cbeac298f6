"""Tests of attnres_dist.data: tokenizers, datasets, prepare-data, windows (the default corpus:
``tests/test_default_corpus.py``)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest
import torch

from attnres_dist import data
from attnres_dist.data import indexed, prepare, prepare_cmd
from attnres_dist.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from attnres_dist.errors import ConfigError, DataError

TEXTS = ["hello world\n", "déjà vu — ünïcödé ✓\n", "def f(x):\n    return x + 1\n", "a" * 50]


def make_hf_tokenizer(path, special=("<|endoftext|>",)) -> str:
    """A tiny byte-level BPE tokenizer.json trained locally on a few strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 5, trainer=trainer)
    tok.save(str(path))
    return str(path)


def write_inputs(tmp_path, docs: list[str]) -> list[str]:
    """Half the documents as .txt files, the rest as one .jsonl file."""
    paths = []
    half = len(docs) // 2
    for i, text in enumerate(docs[:half]):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    jl = tmp_path / "more.jsonl"
    jl.write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs[half:]))
    )
    return paths + [str(jl)]


def read_docs(prefix: str, split: str) -> list[list[int]]:
    ds = indexed.open_split(prefix, split)
    return [ds[i].tolist() for i in range(len(ds))]


DOCS = [f"document number {i}: " + "xyz " * (i % 7) for i in range(40)]


# -- tokenizers --------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eod, tok.name) == (257, 256, "bytes")
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and tok.eod not in ids
        assert tok.decode(ids + [tok.eod, 999]) == text


def test_hf_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer("hf", make_hf_tokenizer(tmp_path / "tok.json"))
    assert isinstance(tok, HFTokenizer) and tok.name == "hf"
    assert tok.eod == 0 and tok.vocab_size <= 300
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.eod not in ids and max(ids) < tok.vocab_size
        assert tok.decode(ids + [tok.eod]) == text


def test_hf_tokenizer_eod_errors(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tok.json", special=("<pad>",))
    with pytest.raises(DataError, match="no end-of-document token"):
        HFTokenizer(path)
    assert HFTokenizer(path, eod_token="<pad>").eod == 0
    with pytest.raises(DataError, match="'<nope>' is not in the vocabulary"):
        HFTokenizer(path, eod_token="<nope>")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a valid Hugging Face tokenizer.json"):
        HFTokenizer(str(bad))


def test_build_tokenizer_errors(tmp_path):
    assert isinstance(build_tokenizer("bytes", None), ByteTokenizer)
    with pytest.raises(DataError, match="unknown kind 'gpt9'"):
        build_tokenizer("gpt9", None)
    with pytest.raises(DataError, match="needs the path"):
        build_tokenizer("hf", None)
    with pytest.raises(DataError, match="tokenizer file not found"):
        build_tokenizer("hf", str(tmp_path / "missing.json"))


# -- prepare-data and indexed datasets ---------------------------------------------------------


def test_prepare_round_trip_and_metadata(tmp_path):
    tok = ByteTokenizer()
    inputs = write_inputs(tmp_path, DOCS)
    prefix = str(tmp_path / "out" / "ds")
    assert data.prepare_dataset(inputs, prefix, tok, valid_fraction=0.2) == prefix

    hashes = [prepare.doc_hash(t, 0) for t in DOCS]
    valid = prepare.choose_valid(hashes, 0.2)
    assert 0 < len(valid) < len(DOCS)
    expect = {
        "train": [tok.encode(t) + [tok.eod] for i, t in enumerate(DOCS) if i not in valid],
        "valid": [tok.encode(t) + [tok.eod] for i, t in enumerate(DOCS) if i in valid],
    }
    for split in ("train", "valid"):
        assert read_docs(prefix, split) == expect[split]

    meta = indexed.read_metadata(prefix)
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 257 and meta["eod"] == 256
    assert meta["dtype"] == "uint16" and meta["format_version"] == indexed.FORMAT_VERSION
    assert meta["max_token_id"] == 256
    for split in ("train", "valid"):
        assert meta["splits"][split]["docs"] == len(expect[split])
        assert meta["splits"][split]["tokens"] == sum(map(len, expect[split]))
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        os.path.basename(f) for f in indexed.dataset_files(prefix)
    )


def test_split_is_deterministic_and_order_independent(tmp_path):
    tok = ByteTokenizer()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    pa = data.prepare_dataset(write_inputs(a, DOCS), str(a / "ds"), tok, valid_fraction=0.2)
    pb = data.prepare_dataset(write_inputs(b, DOCS), str(b / "ds"), tok, valid_fraction=0.2)
    for f_a, f_b in zip(indexed.dataset_files(pa), indexed.dataset_files(pb), strict=True):
        if f_a.endswith(".json"):
            continue  # metadata names its input files, which differ
        assert open(f_a, "rb").read() == open(f_b, "rb").read()
    # Reversed input order: same documents in each split (content decides, not position).
    c = tmp_path / "c"
    c.mkdir()
    pc = data.prepare_dataset(write_inputs(c, DOCS[::-1]), str(c / "ds"), tok, valid_fraction=0.2)
    for split in ("train", "valid"):
        assert sorted(map(tuple, read_docs(pa, split))) == sorted(map(tuple, read_docs(pc, split)))
    # Another seed gives another split.
    pd = data.prepare_dataset(write_inputs(c, DOCS), str(c / "s1"), tok, valid_fraction=0.2, seed=1)
    assert read_docs(pd, "valid") != read_docs(pa, "valid")


def test_prepare_with_hf_tokenizer(tmp_path):
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "tok.json"))
    prefix = data.prepare_dataset(write_inputs(tmp_path, TEXTS), str(tmp_path / "ds"), tok)
    docs = read_docs(prefix, "train") + read_docs(prefix, "valid")
    assert sorted(tok.decode(d) for d in docs) == sorted(TEXTS)
    assert all(d[-1] == tok.eod for d in docs)
    assert indexed.read_metadata(prefix)["tokenizer_path"] == tok.path


def _snapshot(prefix):
    return {f: open(f, "rb").read() for f in indexed.dataset_files(prefix)}


def test_failed_write_leaves_existing_dataset_untouched(tmp_path, monkeypatch):
    tok = ByteTokenizer()
    prefix = data.prepare_dataset(write_inputs(tmp_path, DOCS), str(tmp_path / "ds"), tok)
    before = _snapshot(prefix)
    mcore = indexed._mcore()
    real_add = mcore.IndexedDatasetBuilder.add_document
    calls = []

    def failing_add(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return real_add(self, *args, **kwargs)

    monkeypatch.setattr(mcore.IndexedDatasetBuilder, "add_document", failing_add)
    new_inputs = write_inputs(tmp_path, [d.upper() + "!" for d in DOCS])
    with pytest.raises(OSError, match="disk full"):
        data.prepare_dataset(new_inputs, prefix, tok)
    assert _snapshot(prefix) == before
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_interrupted_swap_is_detected(tmp_path, monkeypatch):
    tok = ByteTokenizer()
    prefix = data.prepare_dataset(write_inputs(tmp_path, DOCS), str(tmp_path / "ds"), tok)
    real_replace = os.replace
    calls = []

    def crash_midway(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(indexed.os, "replace", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        data.prepare_dataset(write_inputs(tmp_path, DOCS[:10]), prefix, tok)
    monkeypatch.undo()
    with pytest.raises(DataError, match="incomplete.*prepare-data"):
        data.open_dataset(prefix, 8, 257)


def test_prepare_input_errors(tmp_path):
    tok = ByteTokenizer()
    out = str(tmp_path / "ds")
    with pytest.raises(DataError, match="input file not found"):
        data.prepare_dataset([str(tmp_path / "nope.txt")], out, tok)
    with pytest.raises(DataError, match="no input files"):
        data.prepare_dataset([], out, tok)
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:4: not valid JSON"):
        data.prepare_dataset([str(jl)], out, tok)
    jl.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no field 'text'.*--text-key"):
        data.prepare_dataset([str(jl)], out, tok)
    jl.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'text' is a int"):
        data.prepare_dataset([str(jl)], out, tok)
    one = tmp_path / "one.txt"
    one.write_text("only one document")
    with pytest.raises(DataError, match="found 1 non-empty documents"):
        data.prepare_dataset([str(one)], out, tok)
    with pytest.raises(DataError, match="--valid-fraction: got 1.5"):
        data.prepare_dataset([str(one), str(one)], out, tok, valid_fraction=1.5)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        data.prepare_dataset([str(latin1), str(one)], out, tok)
    assert not os.path.exists(indexed.meta_path(out))


def test_load_errors(tmp_path):
    with pytest.raises(
        DataError, match=r"ds\.meta\.json: dataset metadata not found.*prepare-data"
    ):
        data.open_dataset(str(tmp_path / "ds"), 8, 257)
    prefix = data.prepare_dataset(
        write_inputs(tmp_path, DOCS), str(tmp_path / "ds"), ByteTokenizer()
    )
    with pytest.raises(DataError, match="token id 256 but the model's vocab size is 100"):
        data.open_dataset(prefix, 8, 100)
    with pytest.raises(DataError, match="the train split has no sample of 100001 tokens"):
        data.open_dataset(prefix, 100_000, 257, cache_dir=str(tmp_path))
    os.remove(prefix + "_valid.idx")
    with pytest.raises(DataError, match=r"ds_valid\.idx: file not found.*prepare-data"):
        data.open_dataset(prefix, 8, 257)


def test_empty_split_is_an_error(tmp_path):
    mcore = indexed._mcore()
    path = str(tmp_path / "empty")
    builder = mcore.IndexedDatasetBuilder(path + ".bin", dtype=np.uint16)
    builder.finalize(path + ".idx")
    with pytest.raises(DataError, match="the split is empty"):
        indexed.open_indexed(path)
    meta_file = tmp_path / "ds.meta.json"
    prefix = data.prepare_dataset(
        write_inputs(tmp_path, DOCS), str(tmp_path / "ds"), ByteTokenizer()
    )
    meta = json.loads(meta_file.read_text())
    meta["splits"]["valid"] = {"docs": 0, "tokens": 0}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="the valid split is empty"):
        data.open_dataset(prefix, 8, 257)


# -- batches -----------------------------------------------------------------------------------


def test_split_micro_batches_reconstructs_global_batch():
    batch = torch.arange(12 * 5).reshape(12, 5)
    for dp_size, mbs in ((1, 12), (2, 3), (3, 2), (4, 1)):
        parts = [data.split_micro_batches(batch, mbs, r, dp_size) for r in range(dp_size)]
        assert all(m.shape == (mbs, 5) for p in parts for m in p)
        assert torch.equal(torch.cat([m for p in parts for m in p]), batch)
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        data.split_micro_batches(batch, 5, 0, 2)


def test_prepare_cmd(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    prepare_cmd.add_parser(parser.add_subparsers(dest="command"))
    inputs = write_inputs(tmp_path, DOCS)
    args = parser.parse_args(
        [
            "prepare-data",
            *inputs,
            "--output",
            str(tmp_path / "ds"),
            "--valid-fraction",
            "0.1",
            "--seed",
            "2",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "valid:" in out and str(tmp_path / "ds") in out
    assert indexed.read_metadata(str(tmp_path / "ds"))["seed"] == 2
    args = parser.parse_args(["prepare-data", *inputs, "--output", "x", "--tokenizer", "hf"])
    with pytest.raises(DataError, match="needs the path"):
        args.func(args)


def test_package_exports():
    for name in data.__all__:
        assert getattr(data, name) is not None
    with pytest.raises(AttributeError):
        data.not_a_name  # noqa: B018
