"""Shared by the launch-script tests: where the scripts are, the environment they run in
(every variable they read cleared, so the caller's shell cannot change what is tested), a
hostfile writer, and waiting for launched jobs (every rank stopped on a timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

LAUNCH = REPO / "launch"
VENV_PY = REPO / ".venv" / "bin" / "python"
LAUNCHERS = ["torchrun", "deepspeed", "mpirun"]

# Variables the scripts read; cleared so the caller's shell cannot change what is tested.
SCRIPT_VARS = [
    "NPROC",
    "NNODES",
    "NODE_RANK",
    "RDZV_ENDPOINT",
    "RDZV_ID",
    "LOCAL_ADDR",
    "MAX_RESTARTS",
    "HOSTFILE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPIRUN",
    "PYTHON",
    "OMP_NUM_THREADS",
]


def script_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS}
    env["PYTHONWARNINGS"] = "ignore"
    env.update(overrides)
    return env


def write_hostfile(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> None:
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        pytest.fail(f"launcher timed out after {timeout} s\n" + tails(logs))
    codes = [proc.returncode for proc in procs]
    assert codes == [0] * len(procs), f"exit codes {codes}\n" + tails(logs)


def tails(logs: list[Path]) -> str:
    out = []
    for log in logs:
        lines = log.read_text(errors="replace").splitlines()
        out.append(f"--- {log.name} (last 40 lines) ---\n" + "\n".join(lines[-40:]))
    return "\n".join(out)
