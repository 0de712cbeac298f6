"""Print the project's runtime requirements that the image must install on top of its base.

docker/Dockerfile installs these, then the project itself with ``--no-deps``. Everything in
pyproject.toml's ``dependencies`` is kept, pins included (DeepSpeed and Megatron-Core versions
are the project's), except what the NGC base already provides as a CUDA build: ``torch``.
Installing PyPI's torch over it would drop the CUDA, NCCL, apex and Transformer Engine builds
the base was made with (NGC's /etc/pip/constraint.txt refuses that anyway). The ``gpu`` extra
(fla-core's fused depth-attention kernel, ``auto``'s choice on CUDA) is added.

Usage: python docker/requirements.py [pyproject.toml]
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PROVIDED_BY_BASE = {"torch"}
IMAGE_EXTRAS = ("gpu",)


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"cannot read a package name from {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def image_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = [r for name in IMAGE_EXTRAS for r in project["optional-dependencies"][name]]
    wanted = [*project["dependencies"], *extras]
    return [r for r in wanted if requirement_name(r) not in PROVIDED_BY_BASE]


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path("pyproject.toml")
    print("\n".join(image_requirements(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
