"""A byte-level code corpus from the Python sources installed on this machine.

    python -m attnres_dist.data.code_corpus --output data/code [--max-mb 256]

For a machine that can fetch no dataset (the lent GPU machine): every non-empty ``*.py`` file
under the interpreter's standard library and its ``site-packages`` directories (``purelib``,
``platlib``), one document each, byte-tokenised (id 256 ends a document), into the trainer's
indexed format (``indexed.py``). Unlike the embedded default corpus (``stdlib_corpus.py``),
which stays independent of what is installed, this one takes everything, so it is larger and
differs between machines: its metadata records where it came from (``roots``), its size and a
hash of its file list (``file_list_sha256``), so two runs can tell whether they trained on the
same data.

* Order: roots in the order above, files in sorted relative-path order inside each; a file
  reachable from two roots (one real path) is read once.
* Split: by a hash of the file's *content*, the lowest ``valid_fraction`` to validation, so a
  file installed twice never straddles the splits and the split does not depend on paths.
* Size: files are taken in order until ``max_bytes`` would be passed (the rest are skipped and
  counted), which keeps the build under a minute where site-packages hold gigabytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import sysconfig
import time

import numpy as np

from attnres_dist.data import indexed
from attnres_dist.data.tokenizer import ByteTokenizer

SKIP_DIRS = {"__pycache__"}
DEFAULT_MAX_BYTES = 256 << 20


def default_roots() -> list[str]:
    """The standard library, then each distinct site-packages directory."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        path = os.path.realpath(paths[key])
        if os.path.isdir(path) and path not in roots:
            roots.append(path)
    return roots


def source_files(roots: list[str]) -> list[tuple[str, str, int]]:
    """(root, relative POSIX path, size) of every non-empty ``*.py`` file, in corpus order;
    a directory that is itself one of ``roots`` is read as that root, not inside another."""
    seen, found = set(), []
    for root in roots:
        others = {r for r in roots if r != root}
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [
                d
                for d in dirnames
                if d not in SKIP_DIRS and os.path.realpath(os.path.join(dirpath, d)) not in others
            ]
            for name in filenames:
                path = os.path.join(dirpath, name)
                real = os.path.realpath(path)
                if not name.endswith(".py") or real in seen or not os.path.isfile(real):
                    continue
                seen.add(real)
                size = os.path.getsize(real)
                if size > 0:
                    files.append((root, os.path.relpath(path, root).replace(os.sep, "/"), size))
        found += sorted(files, key=lambda f: f[1])
    return found


def content_hash(data: bytes) -> float:
    """A stable number in [0, 1) for a file's bytes (the same file, the same split)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0**64


def build_code_corpus(
    prefix: str,
    roots: list[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    valid_fraction: float = 0.02,
) -> dict:
    """Write the corpus to ``prefix``; returns its metadata (sizes, roots, file-list hash)."""
    start = time.perf_counter()
    roots = [os.path.realpath(r) for r in (roots or default_roots())]
    listing = hashlib.sha256()
    taken = skipped = total = 0
    with indexed.DatasetWriter(prefix, ByteTokenizer()) as writer:
        for root, rel, size in source_files(roots):
            if total + size > max_bytes:
                skipped += 1
                continue
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            split = "valid" if content_hash(data) < valid_fraction else "train"
            writer.add(split, np.frombuffer(data, dtype=np.uint8))
            listing.update(f"{roots.index(root)}/{rel}\0{len(data)}\n".encode())
            taken, total = taken + 1, total + len(data)
        return writer.commit(
            {
                "source": "installed-python",
                "python": sys.version.split()[0],
                "roots": roots,
                "files": taken,
                "files_skipped_over_cap": skipped,
                "bytes": total,
                "max_bytes": max_bytes,
                "valid_fraction": valid_fraction,
                "file_list_sha256": listing.hexdigest(),
                "build_seconds": round(time.perf_counter() - start, 3),
            }
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, metavar="PREFIX", help="dataset prefix")
    parser.add_argument("--max-mb", type=int, default=DEFAULT_MAX_BYTES >> 20)
    args = parser.parse_args(argv)
    meta = build_code_corpus(args.output, max_bytes=args.max_mb << 20)
    splits = meta["splits"]
    print(
        f"{args.output}: {meta['files']} files ({meta['files_skipped_over_cap']} over the cap), "
        f"{splits['train']['tokens']:,} + {splits['valid']['tokens']:,} tokens (train + valid) "
        f"in {meta['build_seconds']:.1f} s; file list sha256 {meta['file_list_sha256'][:16]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
