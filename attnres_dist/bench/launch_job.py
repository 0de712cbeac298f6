"""Launch a multi-process benchmark job under torchrun and wait for it.

Benchmarks that measure the pipeline need real ranks. ``torchrun_job`` starts ``python -m
MODULE ARGS`` in ``nproc`` processes on a free rendezvous port (both torchrun and DeepSpeed
default to 29500, which concurrent jobs would fight over) with one intra-op thread per rank
(more oversubscribes the cores: DESIGN.md section 4), and raises with the tail of stderr when
the job fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from attnres_dist.parallel.launch_env import free_port

REPO = Path(__file__).resolve().parents[2]


def torchrun_job(
    module: str,
    args: list[str],
    nproc: int,
    timeout: float = 1800,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    full_env.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "-m",
        module,
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-40:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{tail}")
    return proc
