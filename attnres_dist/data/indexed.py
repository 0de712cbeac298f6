"""On-disk datasets: Megatron indexed ``.bin``/``.idx`` splits plus a JSON metadata file.

A dataset prefix ``P`` owns ``P_train.{bin,idx}``, ``P_valid.{bin,idx}`` and ``P.meta.json``.
Every document is one Megatron sequence: its tokens followed by the tokenizer's EOD id, so a
split's ``.bin`` file read front to back is the EOD-separated token stream. The files are
written and read by megatron-core's own ``IndexedDatasetBuilder`` / ``IndexedDataset``, so
Megatron tooling can open them too.

Writes are crash-safe: everything goes to temporary files in the target directory, is fsynced,
and only then renamed into place, metadata last. The old metadata is removed before the first
rename, so a crash during the (short) swap leaves a dataset that fails to load with a clear
message instead of a silent mix of old and new splits; a failure before the swap leaves the old
dataset untouched.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence

import numpy as np

from attnres_dist.errors import DataError

FORMAT_VERSION = 1
SPLITS = ("train", "valid")
PREPARE_HINT = "create it with `attnres-dist prepare-data FILES... --output {prefix}`"


def _mcore():
    # Imported on first use: importing megatron.core takes seconds and prints warnings, which
    # `attnres-dist --help` and argument errors should not pay for.
    from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def split_prefix(prefix: str, split: str) -> str:
    return f"{prefix}_{split}"


def meta_path(prefix: str) -> str:
    return f"{prefix}.meta.json"


def dataset_files(prefix: str) -> list[str]:
    """Every file of the dataset at ``prefix``, metadata last."""
    files = [split_prefix(prefix, s) + ext for s in SPLITS for ext in (".bin", ".idx")]
    return files + [meta_path(prefix)]


def token_dtype(vocab_size: int) -> type[np.number]:
    # Megatron's own rule (uint16 below 65500 ids, else int32), so the files match what its
    # preprocess_data tool would write for the same vocabulary.
    return _mcore().DType.optimal_dtype(vocab_size)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class DatasetWriter:
    """Streams documents into both splits of a new dataset; ``commit()`` publishes it.

    Use as a context manager: leaving the block without ``commit()`` (e.g. on an exception)
    deletes the temporary files and leaves any existing dataset at ``prefix`` as it was.
    """

    def __init__(self, prefix: str, tokenizer):
        self.prefix = os.fspath(prefix)
        self.tokenizer = tokenizer
        self.dtype = token_dtype(tokenizer.vocab_size)
        directory = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(directory, exist_ok=True)
        self._dir = directory
        tag = f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self._tmp = {s: (split_prefix(self.prefix, s) + tag) for s in SPLITS}
        self._builders = {}
        self.docs = dict.fromkeys(SPLITS, 0)
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.max_token_id = -1
        self._done = False
        builder_cls = _mcore().IndexedDatasetBuilder
        try:
            for split in SPLITS:
                self._builders[split] = builder_cls(self._tmp[split] + ".bin", dtype=self.dtype)
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()

    def add(self, split: str, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document (without EOD; it is added here) to ``split``."""
        doc = np.empty(len(tokens) + 1, dtype=np.int64)
        doc[:-1] = tokens
        doc[-1] = self.tokenizer.eod
        lo, hi = int(doc.min()), int(doc.max())
        if lo < 0 or hi >= self.tokenizer.vocab_size:
            # A casting overflow here would silently corrupt the .bin file: refuse instead.
            raise ValueError(
                f"token id {lo if lo < 0 else hi} outside [0, {self.tokenizer.vocab_size})"
            )
        self._builders[split].add_document(doc, [doc.size])
        self.docs[split] += 1
        self.tokens[split] += doc.size
        self.max_token_id = max(self.max_token_id, hi)

    def commit(self, extra: dict | None = None) -> dict:
        """Finish the splits and atomically replace whatever was at ``prefix``; returns metadata."""
        for split in SPLITS:
            if self.docs[split] == 0:
                raise DataError(
                    split_prefix(self.prefix, split),
                    f"the {split} split would be empty; give at least 2 non-empty documents",
                )
        tok = self.tokenizer
        meta = {
            "format_version": FORMAT_VERSION,
            "tokenizer": tok.name,
            "tokenizer_path": os.path.abspath(tok.path) if tok.path else None,
            "vocab_size": int(tok.vocab_size),
            "eod": int(tok.eod),
            "dtype": np.dtype(self.dtype).name,
            "max_token_id": int(self.max_token_id),
            "splits": {s: {"docs": self.docs[s], "tokens": self.tokens[s]} for s in SPLITS},
            **(extra or {}),
        }
        moves = []
        for split in SPLITS:
            tmp = self._tmp[split]
            self._builders[split].finalize(tmp + ".idx")
            for ext in (".bin", ".idx"):
                _fsync_path(tmp + ext)
                moves.append((tmp + ext, split_prefix(self.prefix, split) + ext))
        meta_tmp = meta_path(self.prefix) + ".tmp-" + secrets.token_hex(6)
        try:
            with open(meta_tmp, "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            _remove_quietly(meta_path(self.prefix))
            for src, dst in moves:
                os.replace(src, dst)
            _fsync_path(self._dir)
            os.replace(meta_tmp, meta_path(self.prefix))
            _fsync_path(self._dir)
        finally:
            _remove_quietly(meta_tmp)
        self._done = True
        return meta

    def abort(self) -> None:
        """Drop the temporary files; the dataset at ``prefix`` (if any) is untouched."""
        self._done = True
        for split in SPLITS:
            builder = self._builders.get(split)
            if builder is not None and not builder.data_file.closed:
                builder.data_file.close()
            for ext in (".bin", ".idx"):
                _remove_quietly(self._tmp[split] + ext)


# -- reading ---------------------------------------------------------------------------------


def read_metadata(prefix: str) -> dict:
    """The validated metadata of the dataset at ``prefix``."""
    path = meta_path(prefix)
    if not os.path.isfile(path):
        present = [f for f in dataset_files(prefix)[:-1] if os.path.exists(f)]
        state = "is incomplete (an interrupted write?)" if present else "not found"
        raise DataError(path, f"dataset metadata {state}; {PREPARE_HINT.format(prefix=prefix)}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(
            path, f"unreadable metadata ({exc}); {PREPARE_HINT.format(prefix=prefix)}"
        ) from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(
            path,
            f"format_version {version!r}, this version reads {FORMAT_VERSION}; "
            f"re-run prepare-data to rewrite the dataset",
        )
    return meta


def open_indexed(path_prefix: str, prefix_for_hint: str | None = None):
    """megatron-core ``IndexedDataset`` at ``path_prefix`` (``.bin``/``.idx``), memory-mapped."""
    hint = PREPARE_HINT.format(prefix=prefix_for_hint or path_prefix)
    for ext in (".bin", ".idx"):
        if not os.path.isfile(path_prefix + ext):
            raise DataError(path_prefix + ext, f"file not found; {hint}")
    if os.path.getsize(path_prefix + ".bin") == 0:
        # megatron-core cannot open it either: numpy refuses to mmap an empty file.
        raise DataError(path_prefix, "the split is empty; re-run prepare-data with more documents")
    try:
        return _mcore().IndexedDataset(path_prefix, mmap=True)
    except (AssertionError, ValueError, OSError) as exc:
        # megatron-core reports a damaged index only through bare asserts.
        raise DataError(
            path_prefix + ".idx", f"unreadable index ({exc or 'bad header'}); re-run prepare-data"
        ) from None


def open_split(prefix: str, split: str, meta: dict | None = None):
    """megatron-core ``IndexedDataset`` of one split, checked against the metadata."""
    meta = read_metadata(prefix) if meta is None else meta
    sp = split_prefix(prefix, split)
    info = meta["splits"][split]
    if info["docs"] == 0 or info["tokens"] == 0:
        raise DataError(sp, f"the {split} split is empty; re-run prepare-data with more documents")
    dataset = open_indexed(sp, prefix)
    itemsize = np.dtype(meta["dtype"]).itemsize
    bin_size = os.path.getsize(sp + ".bin")
    if bin_size != info["tokens"] * itemsize:
        raise DataError(
            sp + ".bin",
            f"{bin_size} bytes, metadata says {info['tokens']} tokens x {itemsize} bytes; "
            "the dataset is corrupt or mixed from two writes: re-run prepare-data",
        )
    if len(dataset) != info["docs"] or np.dtype(dataset.index.dtype) != np.dtype(meta["dtype"]):
        raise DataError(
            sp + ".idx",
            f"{len(dataset)} documents of {np.dtype(dataset.index.dtype).name}, metadata says "
            f"{info['docs']} of {meta['dtype']}; re-run prepare-data",
        )
    return dataset


def check_vocab(prefix: str, meta: dict, vocab_size: int) -> None:
    """Refuse a model whose embedding table cannot hold every token id in the data."""
    top = int(meta["max_token_id"])
    if top >= vocab_size:
        raise DataError(
            meta_path(prefix),
            f"the data has token id {top} but the model's vocab size is {vocab_size}; "
            f"set model.vocab_size to at least {top + 1} (the tokenizer has "
            f"{meta['vocab_size']} tokens)",
        )


def load_dataset(prefix: str, vocab_size: int | None = None) -> tuple:
    """(train IndexedDataset, valid IndexedDataset, metadata); ``vocab_size`` is the model's."""
    prefix = os.fspath(prefix)
    meta = read_metadata(prefix)
    check_vocab(prefix, meta, int(vocab_size) if vocab_size else int(meta["vocab_size"]))
    train, valid = (open_split(prefix, s, meta) for s in SPLITS)
    return train, valid, meta
