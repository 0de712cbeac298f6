"""The checkpoint store's crash safety, in one process with small synthetic checkpoints.

A crash is simulated at every file-system step of a commit (each write, rename and replace
raises in turn): whatever step it hits, the previous checkpoint must still be found intact.
Truncated, bit-flipped and half-written checkpoints are named in a warning and skipped for the
previous valid one; ``latest`` moves last; the newest ``keep_last`` survive pruning.
"""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

from attnres_dist.checkpoint import store


def save(root, step: int, value: float = 0.0):
    """A committed checkpoint holding one tensor filled with ``value``."""
    tmp = store.begin(root, step)
    tensors = {"model/w": torch.full((4, 4), value)}
    info = store.write_bytes(tmp / "stage-000.safetensors", safetensors.torch.save(tensors))
    info["tensors"] = {"model/w": [4, 4]}
    return store.commit(root, step, {"stage-000.safetensors": info}, {"config": {}})


def newest(root):
    warnings: list[str] = []
    ckpt = store.newest_valid(root, warnings.append)
    return ckpt, warnings


def test_commit_verify_and_latest(tmp_path):
    save(tmp_path, 1)
    path = save(tmp_path, 2, 2.0)
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    ckpt, warnings = newest(tmp_path)
    assert ckpt.path == path and ckpt.step == 2 and warnings == []
    assert not list(tmp_path.glob(".tmp-*"))


def test_keep_last(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step)
        store.prune(tmp_path, keep_last=2)
    assert [s for s, _ in store.step_dirs(tmp_path)] == [5, 4]


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "missing"])
def test_damaged_newest_is_skipped_with_a_warning(tmp_path, damage):
    save(tmp_path, 1)
    bad = save(tmp_path, 2)
    data = bad / "stage-000.safetensors"
    if damage == "truncate":
        os.truncate(data, data.stat().st_size - 10)
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[-1] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "manifest":  # valid JSON, wrong content
        manifest = bad / store.MANIFEST
        manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 3'))
    else:
        data.unlink()
    ckpt, warnings = newest(tmp_path)
    assert ckpt.step == 1
    assert len(warnings) == 1 and str(bad) in warnings[0]
    assert ("missing" if damage == "missing" else "damaged") in warnings[0]
    with pytest.raises(store.CheckpointError, match=str(bad)):
        store.resolve(bad, print)  # named directly, a damaged checkpoint is an error


def test_all_damaged_is_an_error_not_a_fresh_start(tmp_path):
    bad = save(tmp_path, 1)
    os.truncate(bad / "stage-000.safetensors", 3)
    with pytest.raises(store.CheckpointError, match="none of its 1 checkpoint"):
        newest(tmp_path)


def test_interrupted_save_leaves_previous(tmp_path):
    save(tmp_path, 1)
    tmp = store.begin(tmp_path, 2)  # a save that never reaches its commit
    store.write_bytes(tmp / "stage-000.safetensors", b"partial")
    ckpt, warnings = newest(tmp_path)
    assert ckpt.step == 1 and warnings == []
    save(tmp_path, 2)  # the next save of that step starts from a clean temporary directory
    assert newest(tmp_path)[0].step == 2


def test_checkpoint_not_named_by_latest_is_ignored(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    store.write_bytes(tmp_path / "latest", b"step-00000001\n")  # crash before latest moved
    ckpt, warnings = newest(tmp_path)
    assert ckpt.step == 1
    assert "step-00000002" in warnings[0] and "did not finish" in warnings[0]


def _crash_on(monkeypatch, call: int):
    """Make the ``call``-th file-system step of a commit raise, like a crash there."""
    counter = {"n": 0}
    real = {"rename": os.rename, "replace": os.replace, "write": store.write_bytes}

    def step(name):
        def run(*args, **kwargs):
            counter["n"] += 1
            if counter["n"] == call:
                raise OSError(f"simulated crash in {name}")
            return real[name](*args, **kwargs)

        return run

    monkeypatch.setattr(store.os, "rename", step("rename"))
    monkeypatch.setattr(store.os, "replace", step("replace"))
    monkeypatch.setattr(store, "write_bytes", step("write"))
    return counter


SAVE_STEPS = 5  # write data, write manifest, rename directory, write + replace ``latest``


@pytest.mark.parametrize("call", range(1, SAVE_STEPS + 2))
def test_crash_at_any_step_of_a_save_keeps_a_valid_checkpoint(tmp_path, monkeypatch, call):
    save(tmp_path, 1, 1.0)
    with monkeypatch.context() as patch:
        counter = _crash_on(patch, call)
        try:
            save(tmp_path, 2, 2.0)
            crashed = False
        except OSError:
            crashed = True
    assert crashed == (call <= SAVE_STEPS) and counter["n"] == min(call, SAVE_STEPS)
    ckpt, _ = newest(tmp_path)
    assert ckpt.step == (1 if crashed else 2)
    tensor = safetensors.torch.load_file(ckpt.path / "stage-000.safetensors")["model/w"]
    assert float(tensor[0, 0]) == float(ckpt.step)
