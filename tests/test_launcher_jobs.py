"""Real 2-stage pipeline jobs through launch/{torchrun,deepspeed,mpirun}.sh (their
``--dry-run`` output: test_launcher_dry_run.py).

Each runs to completion on one node (also with the virtual-stage schedules) and as two
simulated nodes on this machine, and its summary.json is checked. Each real job spends most of
its ~10-30 s importing Megatron-Core and DeepSpeed in every rank.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
from pathlib import Path

import pytest

from attnres_dist.parallel.launch_env import free_port
from tests.launch_scripts import (
    LAUNCH,
    LAUNCHERS,
    REPO,
    script_env,
    tails,
    wait_all,
    write_hostfile,
)

# Two pipeline stages, two layers, three steps: the smallest job that still exercises the
# pipeline engine end to end (send/recv between stages, evaluation, summary).
TINY_JOB = [
    "--config",
    "configs/tiny.yaml",
    "parallel.pp=2",
    "train.steps=3",
    "optim.warmup_steps=0",
    "train.eval_every=0",
    "train.eval_batches=2",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.progress=false",
]


SCHEDULES = {
    "1f1b": [],
    "dualpipev": ["parallel.schedule=dualpipev"],
    "interleaved": ["parallel.schedule=interleaved", "parallel.virtual_stages=2"],
}
VIRTUAL_JOB = ["model.num_layers=4", "train.global_batch_size=8"]


def start(
    launcher: str,
    run_dir: Path,
    log: Path,
    schedule: str = "1f1b",
    extra: tuple[str, ...] = (),
    **env: str,
) -> subprocess.Popen:
    """Start a launch script in its own session, so a timeout can stop every rank it started."""
    job = [*TINY_JOB, *(VIRTUAL_JOB + SCHEDULES[schedule] if schedule != "1f1b" else []), *extra]
    return subprocess.Popen(
        [str(LAUNCH / f"{launcher}.sh"), *job, f"output.run_dir={run_dir}"],
        cwd=REPO,
        env=script_env(**env),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def assert_finished(run_dir: Path, logs: list[Path]) -> None:
    summary_path = run_dir / "summary.json"
    assert summary_path.exists(), tails(logs)
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 3
    assert math.isfinite(summary["final_valid_loss"])
    assert any("final validation loss" in log.read_text(errors="replace") for log in logs)


# every launcher with 1f1b, and each virtual schedule under one launcher (the launch path does
# not depend on the schedule; the schedules' numbers are tested without a launcher)
ONE_NODE = [(launcher, "1f1b") for launcher in LAUNCHERS] + [
    ("torchrun", "dualpipev"),
    ("deepspeed", "interleaved"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "schedule"), ONE_NODE, ids=lambda x: x)
def test_real_two_stage_job_on_one_node(launcher, schedule, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / f"{launcher}.log"
    cores = sorted(os.sched_getaffinity(0))
    bind = len(cores) >= 2 and schedule == "1f1b"  # each launcher says 2 ranks share the host
    extra = ("runtime.cpu_binding=cores",) if bind else ()
    wait_all([start(launcher, run_dir, log, schedule, extra)], [log])
    assert_finished(run_dir, [log])
    if bind:
        bound = f"cpu_binding=cores (local rank 0: cores {cores[0]}"
        assert bound in log.read_text(errors="replace"), tails([log])
    if schedule != "1f1b":  # the start-up line names the schedule that ran
        assert f"schedule: {schedule}," in log.read_text(errors="replace"), tails([log])


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_real_two_stage_job_on_two_simulated_nodes(launcher, tmp_path):
    """Two nodes of one rank each, both on this machine, through each multi-node path."""
    run_dir = tmp_path / "run"
    if launcher == "mpirun":
        # hydra treats "localhost" and this host's name as two hosts and starts both locally
        hostfile = write_hostfile(
            tmp_path / "hosts", f"localhost slots=1\n{socket.gethostname()} slots=1\n"
        )
        log = tmp_path / "mpirun.log"
        wait_all([start("mpirun", run_dir, log, HOSTFILE=hostfile)], [log])
        assert_finished(run_dir, [log])
        return
    if launcher == "torchrun":
        common = dict(
            NNODES="2", NPROC="1", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID="test"
        )
    else:
        hostfile = write_hostfile(tmp_path / "hosts", "node-0 slots=1\nnode-1 slots=1\n")
        common = dict(HOSTFILE=hostfile, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    logs = [tmp_path / f"{launcher}-node{rank}.log" for rank in range(2)]
    procs = [
        start(launcher, run_dir, logs[rank], NODE_RANK=str(rank), **common) for rank in range(2)
    ]
    wait_all(procs, logs)
    assert_finished(run_dir, logs)
