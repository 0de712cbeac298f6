"""Shared by the launch-script tests: where the scripts are, the environment they run in
(every variable they read cleared, so the caller's shell cannot change what is tested), and a
hostfile writer."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
VENV_PY = REPO / ".venv" / "bin" / "python"
LAUNCHERS = ["torchrun", "deepspeed", "mpirun"]

# Variables the scripts read; cleared so the caller's shell cannot change what is tested.
LAUNCH_VARS = [
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
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONWARNINGS"] = "ignore"
    env.update(overrides)
    return env


def write_hostfile(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)
