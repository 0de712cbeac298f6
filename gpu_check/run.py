"""The GPU check's driver: install like docker/Dockerfile, run each step time-boxed, write gpu.md.

    python3 -m gpu_check.run --out DIR [--wheels .whl] [--budget-s 480] [--dry-run]

Standard library only (it runs before the project's requirements are installed). Install
steps, as in the Dockerfile: a virtualenv over the base environment's site-packages, the list
``docker/requirements.py`` prints installed from the carried wheels (``--no-index``), the project
with ``--no-deps``, ``docker/check_base.py``, ``check-config``. The base Python may itself be a
virtualenv (the GPU machine's is), whose packages ``--system-site-packages`` would not see: a
``.pth`` file adds its site-packages after the new venv's own, which is what that option means
for a system Python. Every later step runs ``python -m gpu_check.steps NAME`` with
the venv's Python, in its own process group (a crash or a CUDA error ends one step only; a
timeout kills what the step started), under a time limit cut to what is left of the budget and
passed to it as ``GPU_CHECK_STEP_S``. The timed steps run alone; then the CUDA tests run beside
the training smoke runs. ``--dry-run`` does the same on a CPU: pip only
resolves (``--dry-run``), the steps use tiny sizes and skip what needs CUDA, with the reason.

DIR receives ``gpu.md``, ``gpu_check.json`` (every step's status and result) and ``steps.log``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_check import report

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    cap_s: int  # the step's own time limit (cut further to what is left of the budget)
    what: str
    lane: int = 0  # 0: alone, in order, before the rest; 1, 2: those two lanes run side by side
    default: bool = True  # False: runs only when named in --only


# in order of importance: the budget may run out before the end
INSTALL = (
    Step("venv", 60, "virtualenv over the base environment's site-packages"),
    Step("requirements", 150, "docker/requirements.py's list from the carried wheels"),
    Step("project", 90, "the project with --no-deps, then check-config (as the Dockerfile)"),
    Step("check_base", 120, "docker/check_base.py (expects an NGC base: TE and apex)"),
    Step("bench_extras", 60, "fla-core and flash-attn-res from the wheels (outside kernels)"),
)
# The timed steps run alone; then the correctness tests (mostly Triton compiles, on the CPUs)
# run beside the training smoke runs, whose tokens/s are then a lower bound.
STEPS = (
    Step("machine", 60, "nvidia-smi, versions, the runtime's fast-path choices"),
    Step("depth_attention", 200, "depth-attention implementations: time and memory"),
    Step("step_time", 150, "step time at the 125M shape: baseline vs Block vs Full AttnRes"),
    Step("step_profile", 150, "the step profiled per implementation (--only)", default=False),
    Step("cuda_tests", 240, "pytest -m cuda (beside the training runs)", lane=1),
    Step("train_tiny", 150, "configs/tiny.yaml on one GPU, bf16, local spec (TE if present)", 2),
    Step("generate", 120, "export the tiny run, generate on the GPU", lane=2),
    Step("train_125m", 120, "configs/gpt-125m.yaml on one GPU, bf16, a few steps", lane=2),
    # make gpu-speed: each alone, one device call of about five minutes each (docs/gpu.md)
    Step("speed_125m", 270, "speed at 125M: eager, plain GPT, decode, compiled", 0, False),
    Step("speed_125m_compiled", 270, "speed at 125M: compiled and graphed only", 0, False),
    Step("speed_1b", 270, "speed at 1.3B (24 x 2048, seq 2048, mb 4)", 0, False),
    # make gpu-study: alone, after the install steps, with the rest of the budget
    Step("study", 540, "baseline vs Block vs Full AttnRes at ~21M (--only)", default=False),
)
# What docker/Dockerfile's NGC flavour runs (FLAVOUR's default), read from the one list of
# requirements; tests/test_docker.py holds the two to the same invocation.
REQUIREMENTS = ("docker/requirements.py", "--flavour", "ngc", "pyproject.toml")
CHECK_BASE = ("docker/check_base.py", "--flavour", "ngc", "pyproject.toml")
MIN_STEP_S = 15  # a step with less time left than this is skipped


def run_group(cmd, timeout: float, env=None, cwd=REPO) -> tuple[int | None, str]:
    """(exit code, or None past ``timeout``; stdout and stderr) of a command in its own
    session: a timeout kills what it started too (a step's pytest, say), not only its own
    process, since an orphan would share the GPU with the next step. What it printed before
    the timeout is kept."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out or ""
    return proc.returncode, out


def _run(cmd, log, timeout: float, env=None, cwd=REPO) -> tuple[str, int | None, str]:
    """(status, exit code, output tail) of one command (``run_group``), its output appended
    to ``log``."""
    log.write(f"\n$ {' '.join(map(str, cmd))}\n")
    log.flush()
    rc, out = run_group(cmd, timeout, env=env, cwd=cwd)
    log.write(out + (f"\n[timed out after {timeout:.0f} s]\n" if rc is None else ""))
    log.flush()
    status = "timeout" if rc is None else "ok" if rc == 0 else "failed"
    return status, rc, out[-1500:]


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _base_site_packages() -> list[str]:
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]


def make_venv(venv: Path, log, timeout: float) -> tuple[str, int | None, str]:
    """A virtualenv over this interpreter's packages (``_run``'s result): the base may itself
    be a virtualenv, whose site-packages ``--system-site-packages`` would not see, so a
    ``.pth`` file adds them after the venv's own."""
    cmd = [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv]
    status, rc, tail = _run(cmd, log, timeout)
    if status == "ok":
        site = next((venv / "lib").glob("python*/site-packages"))
        (site / "_gpu_check_base.pth").write_text("\n".join(_base_site_packages()) + "\n")
    return status, rc, tail


def _install_carried(py: Path, wheels: Path, log, tail: str, timeout: float) -> dict:
    """When pip cannot resolve the list against the machine's own packages (an image's
    pins differ from the tested versions), install every carried wheel with ``--no-deps``:
    they are the versions the test suite runs, and the venv's copies shadow the image's.
    The rest of the check then runs; the record keeps the resolver's complaint and
    ``pip check``'s."""
    why = next((ln for ln in tail.splitlines() if ln.startswith("ERROR")), "pip failed")
    cmd = [py, "-m", "pip", "install", "--no-cache-dir", "--no-index", "--no-deps"]
    cmd += sorted(str(w) for w in Path(wheels).glob("*.whl"))
    status, rc, out = _run(cmd, log, timeout)
    if status != "ok":
        return {"status": status, "rc": rc, "tail": out}
    _, _, check = _run([py, "-m", "pip", "check"], log, 60)
    conflicts = [ln for ln in check.splitlines() if " requires " in ln or " has requirement " in ln]
    note = f"resolver: {why[:160]}; installed the carried wheels with --no-deps"
    if conflicts:
        note += f"; pip check: {len(conflicts)} conflict(s), first: {conflicts[0][:160]}"
    return {"status": "ok", "rc": 0, "note": note, "pip_check": check.splitlines()[-20:]}


def install_steps(venv: Path, wheels: Path, work: Path, dry: bool, log, left) -> list[dict]:
    """The Dockerfile's build steps; returns their records."""
    records = []
    py = _venv_python(venv)
    pip_dry = ["--dry-run"] if dry else []
    for step in INSTALL:
        timeout = min(step.cap_s, left())
        start = time.monotonic()
        record = {"name": step.name, "what": step.what}
        if timeout < MIN_STEP_S:
            record |= {"status": "skipped", "note": "no time left"}
        elif step.name == "venv":
            status, rc, tail = make_venv(venv, log, timeout)
            record |= {"status": status, "rc": rc, "tail": tail}
        elif step.name == "requirements":
            reqs = work / "requirements.txt"
            listed = subprocess.run(
                [str(py), *REQUIREMENTS],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            log.write(listed.stdout + listed.stderr)
            if listed.returncode != 0:
                record |= {"status": "failed", "rc": listed.returncode, "tail": listed.stderr}
            else:
                reqs.write_text(listed.stdout)
                record["requirements"] = listed.stdout.split()
                cmd = [py, "-m", "pip", "install", *pip_dry, "--no-cache-dir", "--no-index"]
                cmd += ["--find-links", wheels, "-r", reqs]
                status, rc, tail = _run(cmd, log, timeout)
                record |= {"status": status, "rc": rc, "tail": tail}
                if status == "failed" and not dry:
                    record |= _install_carried(py, wheels, log, tail, min(timeout, left()))
        elif step.name == "project":
            cmd = [py, "-m", "pip", "install", *pip_dry, "--no-cache-dir", "--no-deps"]
            cmd += ["--no-index", "--no-build-isolation", "-e", "."]
            status, rc, tail = _run(cmd, log, timeout)
            if status == "ok":
                check = [py, "-m", "attnres_dist.cli", "check-config", "--config"]
                status, rc, tail = _run([*check, "configs/tiny.yaml"], log, timeout)
            record |= {"status": status, "rc": rc, "tail": tail}
        elif step.name == "bench_extras":
            cmd = [
                py,
                "-m",
                "pip",
                "install",
                *pip_dry,
                "--no-cache-dir",
                "--no-index",
                "--no-deps",
            ]
            cmd += ["--find-links", wheels, "fla-core", "flash-attn-res"]
            status, rc, tail = _run(cmd, log, timeout)
            record |= {"status": status, "rc": rc, "tail": tail}
        elif step.name == "check_base":
            status, rc, tail = _run([py, *CHECK_BASE], log, timeout)
            record |= {"status": status, "rc": rc, "tail": tail}
        record["seconds"] = round(time.monotonic() - start, 1)
        records.append(record)
    return records


def _run_step(step: Step, py: Path, work: Path, dry: bool, log, left) -> dict:
    timeout = min(step.cap_s, left())
    record = {"name": step.name, "what": step.what, "lane": step.lane}
    if timeout < MIN_STEP_S:
        return record | {"status": "skipped", "note": "no time left in the budget"}
    # the step's own limit, so a step that can stop early (pytest, the kernel bench) does
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env["GPU_CHECK_STEP_S"] = f"{timeout:.0f}"
    result_file = work / f"{step.name}.json"
    cmd = [py, "-m", "gpu_check.steps", step.name, "--work", work]
    cmd += ["--result", result_file, *(["--dry-run"] if dry else [])]
    start = time.monotonic()
    status, rc, tail = _run(cmd, log, timeout, env=env)
    record |= {"status": status, "rc": rc, "seconds": round(time.monotonic() - start, 1)}
    if result_file.is_file():
        result = json.loads(result_file.read_text())
        record["result"] = result
        if status == "ok" and result.get("skipped"):
            record["status"] = "skipped"
            record["note"] = result["skipped"]
    if status != "ok":
        record["tail"] = tail
    return record


def run_steps(py: Path, work: Path, dry: bool, log, left, only=None) -> list[dict]:
    """Lane 0's steps one after another, then the other lanes side by side (threads, each
    step still its own process); records in STEPS order."""
    chosen = [s for s in STEPS if s.name in only] if only else [s for s in STEPS if s.default]
    records: dict[str, dict] = {}

    def lane(steps, out) -> None:
        for step in steps:
            records[step.name] = _run_step(step, py, work, dry, out, left)

    lane([s for s in chosen if s.lane == 0], log)
    side = sorted({s.lane for s in chosen} - {0})
    buffers = {k: io.StringIO() for k in side}
    threads = [
        threading.Thread(target=lane, args=([s for s in chosen if s.lane == k], buffers[k]))
        for k in side
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in side:
        log.write(f"\n# lane {k} (ran beside the other lanes)\n" + buffers[k].getvalue())
    return [records[s.name] for s in chosen]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu.md, gpu_check.json")
    parser.add_argument("--wheels", default=str(REPO / ".whl"), help="the carried wheels")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, pip resolves")
    parser.add_argument("--only", nargs="*", default=None, help="run only these steps")
    args = parser.parse_args(argv)
    dry = args.dry_run or os.environ.get("GPU_CHECK_DRY_RUN") == "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    os.environ["GPU_CHECK_OUT"] = str(out.resolve())  # where a step leaves a file to bring back

    def left() -> float:
        return deadline - time.monotonic()

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with (
        tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp,
        open(out / "steps.log", "w") as log,
    ):
        work = Path(tmp)
        venv = work / "venv"
        records = install_steps(venv, Path(args.wheels), work, dry, log, left)
        py = _venv_python(venv) if records[0]["status"] == "ok" else Path(sys.executable)
        records += run_steps(py, work, dry, log, left, args.only)
    summary = {
        "dry_run": dry,
        "started": started,
        "budget_s": args.budget_s,
        "wall_s": round(args.budget_s - left(), 1),
        "base_python": f"{platform.python_version()} at {sys.executable}",
        "wheels": sorted(p.name for p in Path(args.wheels).glob("*.whl")),
        "steps": records,
    }
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "gpu.md").write_text(report.markdown(summary))
    for r in records:
        print(f"{r['name']:16s} {r['status']:8s} {r.get('seconds', 0):6.1f} s  {r.get('note', '')}")
    print(f"wrote {out / 'gpu.md'} ({summary['wall_s']} s of a {args.budget_s:.0f} s budget)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
