"""Tests for launch/{torchrun,deepspeed,mpirun}.sh without a job (launch_env itself:
test_launch_env.py; real jobs: test_launcher_jobs.py).

They check what ``--dry-run`` prints: single node, and multi-node (one line per node for the
per-node launchers, one hostfile-driven line for mpirun); that a misconfigured multi-node launch
fails before starting anything; and ``--help``.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.launch_scripts import LAUNCH, LAUNCHERS, REPO, VENV_PY, script_env, write_hostfile


def dry_run(launcher: str, *args: str, **env: str) -> list[list[str]]:
    """The commands ``--dry-run`` prints, each split as a shell would."""
    proc = subprocess.run(
        [str(LAUNCH / f"{launcher}.sh"), "--dry-run", *args],
        cwd=REPO,
        env=script_env(**env),
        capture_output=True,
        text=True,
        timeout=120,  # a Python start-up or two; generous for a loaded machine
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    return [shlex.split(line) for line in lines]


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading NAME=value words become the environment; the rest is the command."""
    env = {}
    while words and "=" in words[0] and not words[0].startswith(("/", "-")):
        name, value = words[0].split("=", 1)
        env[name] = value
        words = words[1:]
    return env, words


def train_args(cmd: list[str]) -> list[str]:
    """The arguments after ``attnres_dist.cli train``."""
    i = cmd.index("attnres_dist.cli")
    assert cmd[i + 1] == "train"
    return cmd[i + 2 :]


# Arguments that would break on any quoting mistake: a space, quotes, a shell variable.
AWKWARD = ["output.run_dir=/tmp/a dir/it's", 'name="x y"', "tag=$HOME", "--config", "c.yaml"]


# ---------------------------------------------------------------------------------------------
# --dry-run, one node


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_dry_run_single_node_quotes_arguments_and_sets_threads(launcher):
    (line,) = dry_run(launcher, *AWKWARD)
    env, cmd = split_env(line)
    if launcher == "mpirun":
        # hydra gets the variable with -genv NAME VALUE instead of a prefix
        i = cmd.index("-genv")
        assert cmd[i + 1 : i + 3] == ["OMP_NUM_THREADS", "1"]
        assert Path(cmd[0]) == REPO / ".venv" / "bin" / "mpirun"
        assert cmd[cmd.index("-np") + 1] == "2"
    else:
        assert env["OMP_NUM_THREADS"] == "1"
        assert cmd[0] == str(VENV_PY)
    assert str(VENV_PY) in cmd
    assert train_args(cmd) == AWKWARD


def test_dry_run_keeps_user_thread_count_and_nproc():
    (line,) = dry_run("torchrun", OMP_NUM_THREADS="3", NPROC="4")
    env, cmd = split_env(line)
    assert env["OMP_NUM_THREADS"] == "3"
    assert "--nproc-per-node=4" in cmd
    (line,) = dry_run("mpirun", OMP_NUM_THREADS="3", NPROC="4")
    assert line[line.index("-np") + 1] == "4"
    assert line[line.index("-genv") + 1 : line.index("-genv") + 3] == ["OMP_NUM_THREADS", "3"]


def test_dry_run_torchrun_single_node_uses_standalone_rendezvous():
    (line,) = dry_run("torchrun")
    _, cmd = split_env(line)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in cmd  # rendezvous on port 0: never torchrun's default 29500
    assert not any(w.startswith(("--master-port", "--master_port")) for w in cmd)
    assert cmd[cmd.index("--standalone") + 1 :][:2] == ["-m", "attnres_dist.cli"]


def test_dry_run_torchrun_max_restarts_gets_its_own_store():
    (line,) = dry_run("torchrun", MAX_RESTARTS="2")
    env, cmd = split_env(line)
    assert "--max-restarts=2" in cmd
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_dry_run_deepspeed_single_node_sizes_job_and_picks_free_port():
    (line,) = dry_run("deepspeed", NPROC="3")
    _, cmd = split_env(line)
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert "--num_gpus=3" in cmd  # on CPU the runner would otherwise count NUMA nodes
    assert "--hostfile=/dev/null" in cmd
    port = int(next(w for w in cmd if w.startswith("--master_port=")).split("=")[1])
    assert port != 29500 and port > 0
    i = cmd.index("attnres_dist.cli")
    assert cmd[i - 2 : i] == ["--module", "--no_local_rank"]
    (line,) = dry_run("deepspeed", MASTER_PORT="31234")
    assert "--master_port=31234" in line


def test_dry_run_without_venv_puts_checkout_on_pythonpath(tmp_path):
    # An interpreter that cannot import the package: a wrapper running Python in isolated
    # mode (-I drops PYTHONPATH and the user site) with site-packages switched off (-S).
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {VENV_PY} -I -S "$@"\n')
    wrapper.chmod(0o755)
    (line,) = dry_run("torchrun", PYTHON=str(wrapper))
    env, cmd = split_env(line)
    assert env["PYTHONPATH"].split(":")[0] == str(REPO)
    assert cmd[0] == str(wrapper)


# ---------------------------------------------------------------------------------------------
# --dry-run, several nodes


def test_dry_run_torchrun_multi_node_prints_one_line_per_node():
    lines = dry_run(
        "torchrun",
        "train.steps=7",
        NNODES="2",
        NPROC="8",
        RDZV_ENDPOINT="node-a:29400",
        RDZV_ID="job42",
        NODE_RANK="1",
        LOCAL_ADDR="10.0.0.2",
    )
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        _, cmd = split_env(line)
        assert "--nnodes=2" in cmd and "--nproc-per-node=8" in cmd
        assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=node-a:29400" in cmd
        assert "--rdzv-id=job42" in cmd
        assert f"--rdzv-conf=is_host={'true' if rank == 0 else 'false'}" in cmd
        # LOCAL_ADDR describes the node it is set on (NODE_RANK=1) only
        assert ("--local-addr=10.0.0.2" in cmd) == (rank == 1)
        assert "--standalone" not in cmd
        assert train_args(cmd) == ["train.steps=7"]


def test_dry_run_torchrun_elastic_node_range_prints_max_nodes():
    lines = dry_run("torchrun", NNODES="1:3", RDZV_ENDPOINT="h:1234")
    assert len(lines) == 3
    assert all("--nnodes=1:3" in line for line in lines)


def test_dry_run_deepspeed_multi_node_prints_one_line_per_host(tmp_path):
    hostfile = write_hostfile(tmp_path / "hosts", "# two nodes\nnode-a slots=8\n\nnode-b slots=8\n")
    lines = dry_run("deepspeed", "x=1", HOSTFILE=hostfile)
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        env, cmd = split_env(line)
        assert env["OMP_NUM_THREADS"] == "1"
        assert f"--hostfile={hostfile}" in cmd
        assert "--no_ssh" in cmd and f"--node_rank={rank}" in cmd
        assert "--master_addr=node-a" in cmd  # the hostfile's first host runs rank 0
        assert "--master_port=29500" in cmd  # must agree across nodes: no local free port
        assert not any(w.startswith("--num_gpus") for w in cmd)  # the slots decide
        assert train_args(cmd) == ["x=1"]
    lines = dry_run(
        "deepspeed", HOSTFILE=hostfile, MASTER_ADDR="10.0.0.1", MASTER_PORT="6000", NPROC="2"
    )
    assert all(
        "--master_addr=10.0.0.1" in line and "--master_port=6000" in line and "--num_gpus=2" in line
        for line in lines
    )


def test_dry_run_mpirun_multi_node_is_one_command_over_all_hosts(tmp_path):
    hostfile = write_hostfile(tmp_path / "hosts", "node-a slots=8\nnode-b:4\nnode-c\n")
    (line,) = dry_run("mpirun", "x=1", HOSTFILE=hostfile, MASTER_ADDR="10.0.0.1")
    assert line[line.index("-hosts") + 1] == "node-a:8,node-b:4,node-c:1"
    assert line[line.index("-np") + 1] == "13"
    genv = [line[i + 1 : i + 3] for i, w in enumerate(line) if w == "-genv"]
    assert ["MASTER_ADDR", "10.0.0.1"] in genv and ["OMP_NUM_THREADS", "1"] in genv
    assert train_args(line) == ["x=1"]
    (line,) = dry_run("mpirun", HOSTFILE=hostfile, NPROC="4")
    assert line[line.index("-np") + 1] == "4"


def run_script_fast(launcher: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LAUNCH / f"{launcher}.sh"), *args],
        cwd=REPO,
        env=script_env(**env),
        capture_output=True,
        text=True,
        timeout=120,  # a Python start-up or two; generous for a loaded machine
    )


def test_multi_node_misconfigurations_fail_before_launching(tmp_path):
    proc = run_script_fast("torchrun", "--dry-run", NNODES="2")
    assert proc.returncode == 2 and "RDZV_ENDPOINT" in proc.stderr
    proc = run_script_fast("torchrun", NNODES="2", RDZV_ENDPOINT="h:1")
    assert proc.returncode == 2 and "NODE_RANK" in proc.stderr
    proc = run_script_fast("torchrun", NNODES="2", RDZV_ENDPOINT="h:1", NODE_RANK="2")
    assert proc.returncode == 2 and "NODE_RANK=2" in proc.stderr
    hostfile = write_hostfile(tmp_path / "hosts", "a slots=1\nb slots=1\n")
    proc = run_script_fast("deepspeed", HOSTFILE=hostfile)
    assert proc.returncode == 2 and "NODE_RANK" in proc.stderr
    bad = write_hostfile(tmp_path / "bad", "a:1\n")
    proc = run_script_fast("deepspeed", "--dry-run", HOSTFILE=bad)
    assert proc.returncode == 2 and "slots=N" in proc.stderr
    proc = run_script_fast("mpirun", "--dry-run", HOSTFILE=str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_help_prints_the_usage_header():
    for launcher in LAUNCHERS:
        proc = run_script_fast(launcher, "--help")
        assert proc.returncode == 0
        assert proc.stdout.startswith(f"launch/{launcher}.sh:")
        assert "--dry-run" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Real jobs
