"""Checkpoints on disk: the directory format, crash-safe commits, verification and selection.

A checkpoint root (``<run_dir>/checkpoints`` by default) looks like::

    latest                      names the newest committed checkpoint; replaced last
    step-00000400/              one checkpoint
        manifest.json           step, config, schedule, layout, and size + sha256 of every file
        stage-000.safetensors   full (tensor-parallel gathered) tensors by canonical name,
        stage-001.safetensors   one file per pipeline stage that wrote them
        rng.pt                  every rank's RNG states
    .tmp-step-00000600/         a save in progress, or one that a crash interrupted

A save writes every file into the temporary directory and flushes it to disk, writes the
manifest last, flushes the directory, renames it to ``step-N`` and only then replaces
``latest`` (write, flush, rename). ``latest`` is the commit point: a checkpoint counts once
``latest`` has named it, so a crash at any moment leaves every earlier checkpoint as it was.
Loading verifies the manifest's own checksum and every file's size and sha256; a damaged
checkpoint is skipped, with a warning naming it, for the previous valid one.

Nothing here uses torch or torch.distributed; ``state.py`` does the collective parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attnres_dist.errors import UserError

FORMAT = "attnres-dist-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 20


class CheckpointError(UserError):
    """A missing, damaged or incompatible checkpoint."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".tmp-{step_name(step)}"


# ------------------------------------------------------------------------------- writing


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (new, renamed files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | Path, data: bytes) -> dict:
    """Write ``data`` to ``path`` and flush it to disk; returns its size and sha256."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def begin(root: str | Path, step: int) -> Path:
    """A fresh, empty temporary directory for the checkpoint of ``step``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir(root, step)
    if tmp.exists():  # left by a crashed save of the same step
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def _checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def commit(root: str | Path, step: int, files: dict[str, dict], body: dict) -> Path:
    """Write the manifest into the temporary directory, rename it into place, move ``latest``.

    ``files`` maps each file already written (and flushed) in ``tmp_dir(root, step)`` to its
    ``write_bytes`` record.
    """
    root = Path(root)
    tmp = tmp_dir(root, step)
    manifest = {"format": FORMAT, "step": step, **body, "files": files}
    manifest["checksum"] = _checksum(manifest)
    write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    final = root / step_name(step)
    aside = None
    if final.exists():  # an uncommitted leftover of this step, or a second save of it
        aside = root / f".old-{step_name(step)}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    write_bytes(pointer, (step_name(step) + "\n").encode())
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def step_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """Checkpoint directories under ``root`` as (step, path), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` committed checkpoints and any stale temporaries.

    Called by the only writer right after a commit, so no save is in progress.
    """
    root = Path(root)
    latest = read_latest(root)
    removed = []
    for i, (step, path) in enumerate(step_dirs(root)):
        if i >= keep_last and (latest is None or step <= latest):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for entry in root.iterdir():
        if entry.name.startswith((".tmp-", ".old-")) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    return removed


# ------------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """A verified checkpoint directory and its manifest."""

    path: Path
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def config(self) -> dict:
        return self.manifest["config"]

    def tensor_index(self) -> dict[str, str]:
        """Tensor key -> the file that holds it."""
        return {
            key: name
            for name, info in self.manifest["files"].items()
            for key in info.get("tensors", {})
        }

    def tensor_shapes(self) -> dict[str, list[int]]:
        return {
            key: shape
            for info in self.manifest["files"].values()
            for key, shape in info.get("tensors", {}).items()
        }


def read_latest(root: str | Path) -> int | None:
    """The step ``latest`` names, or None when it is missing or unreadable."""
    try:
        text = (Path(root) / LATEST).read_text().strip()
    except OSError:
        return None
    match = _STEP_DIR.match(text)
    return int(match.group(1)) if match else None


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(str(path), f"not a checkpoint ({MANIFEST} is missing)")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(str(path), f"{MANIFEST} is damaged (not valid JSON)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(str(path), f"{MANIFEST} is not an {FORMAT} manifest")
    if manifest.get("checksum") != _checksum(manifest):
        raise CheckpointError(str(path), f"{MANIFEST} is damaged (checksum mismatch)")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path`` after checking its manifest and every file it lists."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, info in sorted(manifest["files"].items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(str(path), f"{name} is missing")
        size = file.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                str(path), f"{name} is damaged ({size} bytes, expected {info['size']}; truncated?)"
            )
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(str(path), f"{name} is damaged (sha256 checksum mismatch)")
    return Checkpoint(path, manifest)


def newest_valid(root: str | Path, warn: Callable[[str], None]) -> Checkpoint | None:
    """The newest committed, intact checkpoint under ``root``; None when there is none at all.

    Damaged checkpoints are named through ``warn`` and skipped. Raises when checkpoints exist
    but none of them is intact, rather than silently starting over.
    """
    root = Path(root)
    found = step_dirs(root)
    if not found:
        return None
    latest = read_latest(root)
    if latest is None:
        warn(f"{root}: no readable '{LATEST}' pointer; trying every checkpoint, newest first")
    candidates = []
    for step, path in found:
        if latest is not None and step > latest:
            warn(f"{path}: ignored, its save did not finish ('{LATEST}' never named it)")
        else:
            candidates.append(path)
    for path in candidates:
        try:
            return verify(path)
        except CheckpointError as exc:
            warn(f"skipping damaged checkpoint {exc}")
    raise CheckpointError(
        str(root),
        f"none of its {len(found)} checkpoint(s) is intact; restore one or set "
        "checkpoint.resume=none to start over",
    )


def resolve(path: str | Path, warn: Callable[[str], None]) -> Checkpoint | None:
    """A checkpoint from a user's path: a checkpoint, a checkpoint root or a run directory.

    A checkpoint named directly must be intact (an error otherwise); in a root (or a run
    directory's ``checkpoints``) the newest intact one is taken.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            str(path), "not found; give a checkpoint, a directory of checkpoints or a run directory"
        )
    if (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
        return verify(path)
    root = path
    if not step_dirs(path) and (path / "checkpoints").is_dir():
        root = path / "checkpoints"
    found = newest_valid(root, warn)
    if found is None:
        raise CheckpointError(
            str(path), "has no checkpoints (no step-* directories with a manifest.json)"
        )
    return found
