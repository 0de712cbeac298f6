"""The embedded default corpus: the running interpreter's standard-library Python source.

Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded, so
the corpus does not depend on what happens to be installed) is one document, byte-tokenised
(or, under ``data.tokenizer: hf``, encoded with that tokenizer: a corpus per tokenizer file),
in sorted relative-path order. Empty files (mostly ``__init__.py``) are skipped.

The ``test`` packages are kept: they are ordinary, idiomatic Python and about 60% of the
source, and with them a small model needs ~2.5x more steps before it starts repeating data.
For CPython 3.11 that is ~1,800 files and ~31 M byte tokens (~63 MB on disk as uint16),
built in a few seconds.

A file goes to the validation split when a stable hash of its relative path falls in the lowest
``VALID_FRACTION`` of the hash range: deterministic, independent of file order, and never split
inside a document. The corpus is built once per cache directory and reused while its
fingerprint (Python version, stdlib location, the sorted file list with sizes) still matches.
Ranks that call ``ensure_default_corpus`` together serialise on a ``flock`` lock file: one
builds, the others then find the finished corpus.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import sysconfig
import time

import numpy as np

from attnres_dist.data import indexed
from attnres_dist.data.tokenizer import ByteTokenizer
from attnres_dist.errors import DataError

CORPUS_VERSION = 1  # bump when the file selection or the split rule changes
VALID_FRACTION = 0.02
SKIP_DIRS = {"site-packages", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[tuple[str, int]]:
    """Sorted (relative POSIX path, size in bytes) of the non-empty ``*.py`` files."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                size = os.path.getsize(path)
                if size > 0:
                    found.append((os.path.relpath(path, root).replace(os.sep, "/"), size))
    found.sort()
    return found


def path_hash(relpath: str) -> float:
    """A stable number in [0, 1) for a relative path (same on every machine and run)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def valid_set(relpaths: list[str], fraction: float = VALID_FRACTION) -> set[str]:
    """The paths of the validation split: never empty, never everything."""
    hashes = {p: path_hash(p) for p in relpaths}
    valid = {p for p, h in hashes.items() if h < fraction}
    if not valid:
        valid = {min(hashes, key=hashes.get)}
    if len(valid) == len(relpaths):
        valid.discard(max(hashes, key=hashes.get))
    return valid


def tokenizer_id(tokenizer) -> str:
    """A short stable name for the tokenizer a corpus is written with ("" for bytes)."""
    if tokenizer is None or tokenizer.name == "bytes":
        return ""
    with open(tokenizer.path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def fingerprint(root: str, files: list[tuple[str, int]], tokenizer=None) -> str:
    h = hashlib.sha256()
    h.update(f"v{CORPUS_VERSION}|{sys.version}|{root}|{VALID_FRACTION}\n".encode())
    h.update(f"tokenizer {tokenizer_id(tokenizer)}\n".encode())
    for rel, size in files:
        h.update(f"{rel}\0{size}\n".encode())
    return h.hexdigest()


def corpus_prefix(cache_dir: str, tokenizer=None) -> str:
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    tok = tokenizer_id(tokenizer)
    return os.path.join(os.fspath(cache_dir), f"stdlib-py{version}" + (f"-{tok}" if tok else ""))


def _is_current(prefix: str, expected: str) -> bool:
    try:
        meta = indexed.read_metadata(prefix)
    except DataError:
        return False
    if meta.get("fingerprint") != expected:
        return False
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, info in meta["splits"].items():
        sp = indexed.split_prefix(prefix, split)
        bin_ok = os.path.isfile(sp + ".bin") and (
            os.path.getsize(sp + ".bin") == info["tokens"] * itemsize
        )
        if not (bin_ok and os.path.isfile(sp + ".idx")):
            return False
    return True


def build_corpus(
    prefix: str, root: str, files: list[tuple[str, int]], fp: str, tokenizer=None
) -> dict:
    """Write the corpus to ``prefix`` (crash-safe, see ``indexed``); returns its metadata.
    ``tokenizer``: a Hugging Face tokenizer (``data.tokenizer: hf``); None = bytes."""
    valid = valid_set([rel for rel, _ in files])
    hf = tokenizer is not None and tokenizer.name != "bytes"
    with indexed.DatasetWriter(prefix, tokenizer if hf else ByteTokenizer()) as writer:
        # Timed from here: creating the writer imports megatron-core (seconds, paid once).
        start = time.perf_counter()
        for rel, _ in files:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            split = "valid" if rel in valid else "train"
            if hf:  # text for a vocabulary of its own (undecodable bytes become U+FFFD)
                writer.add(split, tokenizer.encode(data.decode("utf-8", errors="replace")))
            else:  # the file's raw bytes are its byte tokens, whatever its source encoding
                writer.add(split, np.frombuffer(data, dtype=np.uint8))
        extra = {
            "source": "python-stdlib",
            "stdlib": root,
            "python": sys.version.split()[0],
            "fingerprint": fp,
            "corpus_version": CORPUS_VERSION,
            "valid_files": sorted(valid),
        }
        extra["build_seconds"] = round(time.perf_counter() - start, 3)
        return writer.commit(extra)


def ensure_default_corpus(cache_dir: str = ".cache/data", tokenizer=None) -> str:
    """Prefix of the default corpus in ``cache_dir``, building it on first use; written with
    ``tokenizer`` (a Hugging Face one, e.g. an imported model's) or, by default, as bytes.

    Safe to call from several processes at once (they share one build through a lock file).
    """
    root = stdlib_root()
    files = stdlib_files(root)
    if len(files) < 2:
        raise DataError(
            root,
            f"found {len(files)} Python files in the standard library; point data.path at a "
            "dataset made with `attnres-dist prepare-data` instead",
        )
    prefix = corpus_prefix(cache_dir, tokenizer)
    fp = fingerprint(root, files, tokenizer)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".lock", "a") as lock:
        # Held across check and build: a second process waits, then finds the corpus current.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_current(prefix, fp):
                return prefix
            meta = build_corpus(prefix, root, files, fp, tokenizer)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    splits = meta["splits"]
    print(
        f"built default corpus {prefix}: {splits['train']['docs']} + {splits['valid']['docs']} "
        f"files (train + valid), {splits['train']['tokens']:,} + {splits['valid']['tokens']:,} "
        f"tokens in {meta['build_seconds']:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return prefix
