"""Turn user text into a dataset: plain-text files and JSON-lines files in, indexed splits out.

A ``.jsonl`` input holds one document per line (the string field ``text_key`` of a JSON
object); any other file is one UTF-8 document. Empty documents are skipped.

Documents go to the validation split by a seeded hash of their *content*: the split does not
depend on file names or input order, and exact duplicates always land in the same split, so
they cannot leak from training into validation. At least one document goes to each split.
Inputs are read twice (hash, then tokenize) so that the split is settled before anything is
written and memory stays flat however large the inputs are.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator

from attnres_dist.data import indexed
from attnres_dist.errors import DataError


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            path, f"not UTF-8 (bad byte at offset {exc.start}); convert it, e.g. iconv -t UTF-8"
        ) from None


def _iter_jsonl(path: str, text_key: str) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise DataError(where, "line is not UTF-8; convert the file to UTF-8") from None
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(
                    where, f"not valid JSON ({exc.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(record, dict) or text_key not in record:
                keys = sorted(record)[:5] if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    where,
                    f"no field {text_key!r} (found {keys}); pick the text field with --text-key",
                )
            text = record[text_key]
            if not isinstance(text, str):
                raise DataError(
                    where, f"field {text_key!r} is a {type(text).__name__}, expected a string"
                )
            yield where, text


def iter_documents(inputs: list[str], text_key: str = "text") -> Iterator[tuple[str, str]]:
    """(where, text) of every non-empty document of ``inputs``, in input order."""
    for path in inputs:
        if path.endswith(".jsonl"):
            docs = _iter_jsonl(path, text_key)
        else:
            docs = iter([(path, _read_text(path))])
        for where, text in docs:
            if text:
                yield where, text


def doc_hash(text: str, seed: int) -> float:
    """A number in [0, 1) fixed by the document's content and the seed."""
    digest = hashlib.sha256(f"{seed}\0".encode() + text.encode("utf-8", "surrogatepass"))
    return int.from_bytes(digest.digest()[:8], "big") / 2.0**64


def choose_valid(hashes: list[float], valid_fraction: float) -> set[int]:
    """Indices of validation documents: the hashes below ``valid_fraction``, at least one, and
    never all (needs two or more documents)."""
    valid = {i for i, h in enumerate(hashes) if h < valid_fraction}
    if not valid:
        valid = {min(range(len(hashes)), key=hashes.__getitem__)}
    if len(valid) == len(hashes):
        valid.discard(max(range(len(hashes)), key=hashes.__getitem__))
    return valid


def _check_args(inputs: list[str], text_key: str, valid_fraction: float) -> None:
    if not inputs:
        raise DataError("inputs", "no input files given; pass one or more .txt or .jsonl files")
    for path in inputs:
        if os.path.isdir(path):
            raise DataError(path, "is a directory; pass the files in it, e.g. DIR/*.txt")
        if not os.path.isfile(path):
            raise DataError(path, "input file not found; check the path")
    if not text_key:
        raise DataError("--text-key", "empty; give the JSON field that holds the text")
    if not 0.0 < valid_fraction < 1.0:
        raise DataError(
            "--valid-fraction", f"got {valid_fraction}; must be between 0 and 1, e.g. 0.02"
        )


def prepare_dataset(
    inputs: list[str],
    output_prefix: str,
    tokenizer,
    text_key: str = "text",
    valid_fraction: float = 0.02,
    seed: int = 0,
) -> str:
    """Tokenize ``inputs`` into the dataset ``output_prefix`` (see ``indexed``); returns the
    prefix. An existing dataset there is replaced only once the new one is complete."""
    inputs = [os.fspath(p) for p in inputs]
    output_prefix = os.fspath(output_prefix)
    _check_args(inputs, text_key, valid_fraction)
    hashes = [doc_hash(text, seed) for _, text in iter_documents(inputs, text_key)]
    if len(hashes) < 2:
        raise DataError(
            "inputs",
            f"found {len(hashes)} non-empty documents in {len(inputs)} files; need at least 2 "
            "(one per split): add text, or split a big file into several",
        )
    valid = choose_valid(hashes, valid_fraction)
    with indexed.DatasetWriter(output_prefix, tokenizer) as writer:
        for i, (_, text) in enumerate(iter_documents(inputs, text_key)):
            writer.add("valid" if i in valid else "train", tokenizer.encode(text))
        writer.commit(
            {
                "source": "prepare-data",
                "inputs": [os.path.abspath(p) for p in inputs],
                "text_key": text_key,
                "valid_fraction": valid_fraction,
                "seed": seed,
            }
        )
    return output_prefix
