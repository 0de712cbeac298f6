"""Print the project's runtime requirements that the image installs on top of its base.

The one list both docker/Dockerfile (either flavour) and ``make gpu-check``
(gpu_check/run.py) install, then the project itself with ``--no-deps``. Everything
in pyproject.toml's ``dependencies`` is kept, pins included (DeepSpeed and Megatron-Core versions
are the project's), and the ``gpu`` extra (fla-core's fused depth-attention kernel, ``auto``'s
choice on CUDA) is added. The flavours differ in torch alone:

- ``ngc`` (default): the NGC base already provides torch as a CUDA build, so ``torch`` is left
  out. Installing PyPI's torch over it would drop the CUDA, NCCL, apex and Transformer Engine
  builds the base was made with (NGC's /etc/pip/constraint.txt refuses that anyway).
- ``cpu``: a plain Python base has no torch; the project's pin comes first in the list (the
  Dockerfile finds its CPU wheel with ``--find-links``).

Usage: python docker/requirements.py [--flavour ngc|cpu] [pyproject.toml]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

FLAVOURS = ("ngc", "cpu")
PROVIDED_BY_BASE = {"ngc": {"torch"}, "cpu": set()}
IMAGE_EXTRAS = ("gpu",)


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"cannot read a package name from {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def image_requirements(pyproject: Path, flavour: str = "ngc") -> list[str]:
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour {flavour!r}: use one of {', '.join(FLAVOURS)}")
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = [r for name in IMAGE_EXTRAS for r in project["optional-dependencies"][name]]
    wanted = [*project["dependencies"], *extras]
    wanted.sort(key=lambda r: requirement_name(r) != "torch")  # torch first, the rest in order
    return [r for r in wanted if requirement_name(r) not in PROVIDED_BY_BASE[flavour]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=FLAVOURS, default="ngc")
    parser.add_argument("pyproject", nargs="?", default="pyproject.toml", type=Path)
    args = parser.parse_args(argv[1:])
    print("\n".join(image_requirements(args.pyproject, args.flavour)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
