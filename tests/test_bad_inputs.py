"""Each row of docs/bad_inputs.md: the input gets exactly the documented one-line error, exit 2."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from attnres_dist.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"
ROW = re.compile(r"^\| (\w+) \| `` (.*?) `` \| `` (.*) `` \|$")


def rows():
    found = [ROW.match(line) for line in DOC.read_text().splitlines()]
    return [m.groups() for m in found if m]


def test_table_has_enough_rows():
    assert len(rows()) >= 25


@pytest.mark.parametrize("kind, words, expected", rows(), ids=lambda v: str(v)[:48])
def test_bad_input_gets_documented_error(kind, words, expected, monkeypatch, capsys):
    args = shlex.split(words)
    for word in [w for w in args if re.match(r"^[A-Z_]+=", w)]:
        name, _, value = word.partition("=")
        monkeypatch.setenv(name, value)
        args.remove(word)
    if not any(a.startswith("--config") for a in args):
        args = ["--config=configs/tiny.yaml", *args]
    code = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, f"{kind} input {words!r} exited {code}"
    assert err == [expected]
