"""Each row of docs/bad_inputs.md: the input gets exactly the documented one-line error, exit 2.

``checkpoint``, ``export`` and ``generate`` rows name sample checkpoints as ``$CKPT/...``:
``checkpoint_samples`` writes them (small synthetic checkpoints in the real format) and
``$CKPT`` is replaced by their directory in the input and in the expected message. ``export``
and ``generate`` rows are the words after ``attnres-dist export`` / ``attnres-dist generate``;
every other row's words follow ``attnres-dist train``.
``wandb`` rows run with the wandb package hidden (as if not installed).
"""

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


COMMANDS = ("export", "generate", "import-hf")  # kinds whose words follow their own subcommand


def _sample(root: Path, overrides: list[str], **manifest) -> Path:
    """A committed checkpoint at step 10 for configs/tiny.yaml plus ``overrides``."""
    import safetensors.torch
    import torch

    from attnres_dist.checkpoint import store
    from attnres_dist.checkpoint.state import model_signature
    from attnres_dist.config import load_config

    cfg = load_config("configs/tiny.yaml", overrides)
    tmp = store.begin(root, 10)
    tensors = {"model/final.final_norm.weight": torch.ones(cfg.model.hidden_size)}
    info = store.write_bytes(tmp / "stage-000.safetensors", safetensors.torch.save(tensors))
    info["tensors"] = {key: list(t.shape) for key, t in tensors.items()}
    body = {"config": cfg.to_dict(), "model": model_signature(cfg.model, 384), **manifest}
    return store.commit(root, 10, {"stage-000.safetensors": info}, body)


@pytest.fixture(scope="module")
def checkpoint_samples(tmp_path_factory) -> Path:
    import os

    root = tmp_path_factory.mktemp("ckpt")
    _sample(root / "other-shape", ["model.hidden_size=64"])
    _sample(root / "other-block", ["model.attnres.block_size=4"])
    _sample(root / "dense", [])
    _sample(root / "moe", ["model.moe.num_experts=4"])
    _sample(root / "moe-capacity", ["model.moe.num_experts=4", "model.moe.capacity_factor=1.0"])
    data = _sample(root / "damaged", []) / "stage-000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    data = _sample(root / "truncated", []) / "stage-000.safetensors"
    os.truncate(data, 100)
    (_sample(root / "no-manifest", []) / "manifest.json").unlink()
    manifest = _sample(root / "bad-manifest", []) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 10', '"step": 11'))
    (root / "empty").mkdir()
    gone = {"kind": "hf", "path": "/nonexistent/tokenizer.json", "vocab_size": 300, "eod": 0}
    _sample(root / "hf-tokenizer-gone", [], tokenizer=gone)
    return root


@pytest.fixture(scope="module", autouse=True)
def default_corpus():
    """Build the embedded corpus first: its one-time build notice is not part of any error."""
    from attnres_dist.data import ensure_default_corpus

    ensure_default_corpus(".cache/data")


@pytest.mark.parametrize("kind, words, expected", rows(), ids=lambda v: str(v)[:48])
def test_bad_input_gets_documented_error(kind, words, expected, monkeypatch, capsys, request):
    if kind == "wandb":
        import sys

        monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    if kind == "checkpoint" or kind in COMMANDS:
        samples = str(request.getfixturevalue("checkpoint_samples"))
        words, expected = words.replace("$CKPT", samples), expected.replace("$CKPT", samples)
    args = shlex.split(words)
    for word in [w for w in args if re.match(r"^[A-Z_]+=", w)]:
        name, _, value = word.partition("=")
        monkeypatch.setenv(name, value)
        args.remove(word)
    if kind in COMMANDS:
        code = main([kind, *args])
    else:
        if not any(a.startswith("--config") for a in args):
            args = ["--config=configs/tiny.yaml", *args]
        code = main(["train", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, f"{kind} input {words!r} exited {code}"
    assert err == [expected]
