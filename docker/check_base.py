"""Build-time check that the base image is one this project's pins fit (docker/Dockerfile).

Fails the build, with the reason, when the base cannot run the project. In both flavours: a
Python older than pyproject's ``requires-python``, a torch older than what the installed
Megatron-Core requires. ``ngc`` (default) also: a torch without CUDA, Transformer Engine or apex
missing; it warns when Transformer Engine is outside the range Megatron-Core was tested with
(its ``dev`` extra). ``cpu``: torch must be the project's own pin (the flavour installs it); the
CUDA, Transformer Engine and apex checks do not apply and are reported as such. Prints what it
found, so the build log records the versions. Installed distributions are inspected rather than
imported where possible: a `docker build` has no GPU driver.

Usage (after the requirements are installed):
    python docker/check_base.py [--flavour ngc|cpu] [pyproject.toml]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version


def installed(name: str) -> Version | None:
    try:
        return Version(md.version(name))
    except md.PackageNotFoundError:
        return None


def requirement_of(dist: str, name: str, extra: str | None = None) -> Requirement | None:
    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.name.replace("_", "-").lower() != name:
            continue
        in_extra = req.marker is not None and "extra" in str(req.marker)
        if extra is None and not in_extra:
            return req
        if extra is not None and req.marker is not None and req.marker.evaluate({"extra": extra}):
            return req
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="check the image's base against the pins")
    parser.add_argument("--flavour", choices=("ngc", "cpu"), default="ngc")
    parser.add_argument("pyproject", nargs="?", default="pyproject.toml", type=Path)
    args = parser.parse_args(argv[1:])
    project = tomllib.loads(args.pyproject.read_text())["project"]
    gpu = args.flavour == "ngc"
    problems, warnings = [], []
    python = Version(platform.python_version())
    wanted = project["requires-python"]
    if python not in Requirement(f"python{wanted}").specifier:
        problems.append(f"Python {python} does not satisfy the project's requires-python {wanted}")

    import torch  # imports without a GPU driver; only CUDA calls need one

    torch_version = Version(torch.__version__.split("+")[0])
    if gpu and torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU-only build")
    floor = requirement_of("megatron-core", "torch")
    if floor is not None and torch_version.base_version not in floor.specifier:
        problems.append(f"torch {torch_version} does not satisfy megatron-core's {floor}")
    if not gpu:
        pins = [Requirement(r) for r in project["dependencies"] if r.startswith("torch")]
        for pin in (p for p in pins if p.name == "torch"):
            if not pin.specifier.contains(torch_version, prereleases=True):
                problems.append(f"torch {torch.__version__} is not the project's pin {pin}")

    te = installed("transformer-engine") or installed("transformer_engine")
    if not gpu:
        print("base check (cpu): the CUDA, Transformer Engine and apex checks do not apply")
    elif te is None:
        problems.append("Transformer Engine is not installed (an NGC PyTorch base ships it)")
    else:
        tested = requirement_of("megatron-core", "transformer-engine", extra="dev")
        if tested is not None and not tested.specifier.contains(te, prereleases=True):
            warnings.append(f"transformer-engine {te} is outside megatron-core's tested {tested}")
    apex_files = {str(f) for f in (md.files("apex") or [])} if installed("apex") else set()
    if gpu and "apex/optimizers/fused_adam.py" not in apex_files:
        problems.append("NVIDIA apex (apex.optimizers) is not installed")

    versions = {
        "python": python,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformer-engine": te,
        "apex": installed("apex"),
        "deepspeed": installed("deepspeed"),
        "megatron-core": installed("megatron-core"),
    }
    print(f"base check ({args.flavour}): " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    for text in warnings:
        print(f"base check ({args.flavour}): warning: {text}")
    for text in problems:
        print(f"base check ({args.flavour}): error: {text}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
