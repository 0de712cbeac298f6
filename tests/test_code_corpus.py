"""The code corpus from installed Python sources, on a hand-made tree of roots."""

from __future__ import annotations

import hashlib
import os

from attnres_dist.data import indexed
from attnres_dist.data.code_corpus import build_code_corpus, default_roots, source_files


def fraction(data: bytes) -> float:
    """Where a file's content falls in [0, 1): sha256's first 8 bytes, big-endian."""
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0**64


def make_tree(tmp_path):
    """stdlib/ holding site-packages/ (a root of its own), a cache, an empty file, a link."""
    std, site = tmp_path / "std", tmp_path / "std" / "site-packages"
    (std / "pkg").mkdir(parents=True)
    (std / "__pycache__").mkdir()
    (site / "lib").mkdir(parents=True)
    files = {
        std / "b.py": b"import os\n",
        std / "a.py": b"x = 1\n" * 10,
        std / "pkg" / "mod.py": b"def f():\n    return 2\n",
        std / "pkg" / "empty.py": b"",
        std / "notes.txt": b"not python",
        std / "__pycache__" / "cached.py": b"skipped",
        site / "lib" / "core.py": "caf\u00e9 = 'd\u00e9j\u00e0'\n".encode(),
        site / "top.py": b"import os\n",  # the same bytes as std/b.py
    }
    for path, data in files.items():
        path.write_bytes(data)
    os.symlink(std / "a.py", site / "alias.py")  # one real file, read once
    return [str(std), str(site)], files


def expected_order(tmp_path, files):
    """(root index, relative path, bytes) of the tree's Python files in corpus order."""
    std, site = tmp_path / "std", tmp_path / "std" / "site-packages"
    order = [
        (0, std, "a.py"),
        (0, std, "b.py"),
        (0, std, "pkg/mod.py"),
        (1, site, "lib/core.py"),
        (1, site, "top.py"),
    ]
    return [(i, rel, files[root / rel]) for i, root, rel in order]


def test_files_in_root_then_path_order_each_real_file_once(tmp_path):
    roots, files = make_tree(tmp_path)
    listed = [(roots.index(root), rel, size) for root, rel, size in source_files(roots)]
    assert listed == [(i, rel, len(data)) for i, rel, data in expected_order(tmp_path, files)]


def test_documents_split_by_content_and_recorded(tmp_path):
    roots, files = make_tree(tmp_path)
    docs = expected_order(tmp_path, files)
    # the cut just above the two identical files' content: both are validation documents
    cut = fraction(b"import os\n") + 1e-12
    valid_docs = [data for _, _, data in docs if fraction(data) < cut]
    train_docs = [data for _, _, data in docs if fraction(data) >= cut]
    if not train_docs:  # every other content hashed lower: cut just below instead
        cut = fraction(b"import os\n") - 1e-12
        valid_docs = [data for _, _, data in docs if fraction(data) < cut]
        train_docs = [data for _, _, data in docs if fraction(data) >= cut]
    prefix = str(tmp_path / "out" / "code")
    meta = build_code_corpus(prefix, roots, valid_fraction=cut)
    for split, expected in (("valid", valid_docs), ("train", train_docs)):
        ds = indexed.open_split(prefix, split)
        assert [ds[i].tolist() for i in range(len(ds))] == [list(d) + [256] for d in expected]
    assert (b"import os\n" in valid_docs) != (b"import os\n" in train_docs)  # never both
    assert meta["files"] == 5 and meta["bytes"] == sum(len(d) for _, _, d in docs)
    assert meta["source"] == "installed-python" and meta["roots"] == roots
    listing = "".join(f"{i}/{rel}\0{len(data)}\n" for i, rel, data in docs)
    assert meta["file_list_sha256"] == hashlib.sha256(listing.encode()).hexdigest()


def test_cap_skips_what_does_not_fit_in_order(tmp_path):
    roots, _ = make_tree(tmp_path)
    hashes = sorted([fraction(b"x = 1\n" * 10), fraction(b"import os\n")])
    meta = build_code_corpus(str(tmp_path / "capped"), roots, 75, sum(hashes) / 2)
    # a.py (60) + b.py (10) = 70; mod.py (22) and core.py (19) would pass 75; top.py is skipped
    # too (70 + 10 > 75)
    assert meta["files"] == 2 and meta["bytes"] == 70 and meta["files_skipped_over_cap"] == 3


def test_default_roots_are_the_interpreters():
    import sysconfig

    roots = default_roots()
    assert roots[0] == os.path.realpath(sysconfig.get_paths()["stdlib"])
    assert os.path.realpath(sysconfig.get_paths()["purelib"]) in roots
    assert len(roots) == len(set(roots))
