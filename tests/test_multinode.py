"""Multi-node launching: Slurm and hydra dry-runs, and a pp=2 job across two simulated hosts.

The dry-run checks cover what tests/test_launcher_dry_run.py does not: launch/slurm.sbatch
(srun + torchrun, one line per node), torchrun.sh taking NODE_RANK from SLURM_NODEID, and extra
hydra options for mpirun.sh (MPIRUN_ARGS).

Two namespaces joined by a veth pair stand in for two machines (DESIGN.md section 4): their
addresses (10.78.0.1/24, 10.78.0.2/24) exist only inside them, the link's interface has the
same name in both so one GLOO_SOCKET_IFNAME fits every rank, and both are deleted at the end
(with the link) whatever happens. Each host runs one rank of the same 2-stage job:

* torchrun: one `launch/torchrun.sh` node per namespace, node 0 hosting the c10d rendezvous;
* mpirun: one `launch/mpirun.sh` started in the first namespace with a hostfile of both
  addresses. Hydra reaches the second host through its ssh launcher with `-launcher-exec`
  pointing at a script that runs the command in that host's namespace instead of over ssh
  (`MPIRUN_ARGS`), and `-localhost` tells the remote proxy where to call back.

The host name is the same in both namespaces, so each node's address is given explicitly
(torchrun's LOCAL_ADDR, mpirun's MASTER_ADDR), as on clusters where names do not resolve to
the interface the job should use. Per-step training losses must equal the same config's run
on one host (torchrun, 2 ranks) within 1e-5. Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.launch_scripts import tails, wait_all

SUBNET = "10.78.0"
IFACE = "arnet0"  # the veth end's name inside each namespace
RDZV_PORT = 29400  # free by construction: the namespaces are new
TOL = 1e-5
TIMEOUT_S = 600

JOB = [
    "--config",
    "configs/tiny.yaml",
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "model.attnres.block_size=3",  # stage boundary inside a block: a partial block crosses it
    "parallel.pp=2",
    "train.steps=3",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.progress=false",
    "optim.warmup_steps=1",
    "output.tensorboard=false",
]


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    return None


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@dataclass
class Host:
    netns: str
    addr: str


@pytest.fixture(scope="module")
def hosts():
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tag = f"arn{os.getpid() % 10**6}"
    namespaces = [f"{tag}a", f"{tag}b"]
    created: list[str] = []
    try:
        for ns in namespaces:
            try:
                ip("netns", "add", ns)
            except RuntimeError as exc:
                if not created:  # e.g. a container without the capability
                    pytest.skip(f"cannot create a network namespace here: {exc}")
                raise
            created.append(ns)
        ends = [f"{tag}x", f"{tag}y"]
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        result = []
        for i, (ns, end) in enumerate(zip(namespaces, ends, strict=True)):
            addr = f"{SUBNET}.{i + 1}"
            ip("link", "set", end, "netns", ns)
            ip("-n", ns, "link", "set", end, "name", IFACE)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            ip("-n", ns, "link", "set", IFACE, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            result.append(Host(ns, addr))
        yield result
    finally:
        for ns in created:
            stop_namespace_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def stop_namespace_processes(ns: str) -> None:
    """Kill what this module started in ``ns`` (nothing else runs in a namespace it created)."""
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in proc.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


# Launcher inputs, and what an in-process process group of an earlier test leaves in
# os.environ (RANK, WORLD_SIZE, ...): inherited, they would tell the ranks a different world.
INHERITED = {
    *("NPROC", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_PORT", "HOSTFILE"),
    *("SRUN_ARGS", "MPIRUN_ARGS", "PYTHON", "LOCAL_ADDR", "MASTER_ADDR", "MASTER_PORT"),
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
}


def clean_env(**env: str) -> dict[str, str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in INHERITED
        and not k.startswith(("SLURM_", "PMI_", "MPI_", "OMPI_", "TORCHELASTIC_"))
    }
    clean.update(PYTHONWARNINGS="ignore", **env)
    return clean


def start(cmd: list[str], log: Path, env: dict[str, str], netns: str | None = None):
    full_env = clean_env(**env)
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.Popen(
        [*prefix, *cmd],
        cwd=REPO,
        env=full_env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def losses(run_dir: Path, logs: list[Path]) -> list[float]:
    summary = run_dir / "summary.json"
    assert summary.exists(), tails(logs)
    # the start-up report: one line saying which fast paths were taken, from rank 0 only
    report = [
        line
        for log in logs
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith("runtime: ")
    ]
    assert len(report) == 1 and "layer_spec=local" in report[0], report
    return json.loads(summary.read_text())["train_losses"]


def launch(script: str) -> list[str]:
    return [str(REPO / "launch" / script)]


@pytest.fixture(scope="module")
def single_host(small_dataset, tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("single_host")
    run_dir, log = tmp / "run", tmp / "single.log"
    args = [*JOB, f"data.path={small_dataset}", f"output.run_dir={run_dir}"]
    proc = start(launch("torchrun.sh") + args, log, {"NPROC": "2"})
    wait_all([proc], [log], timeout=TIMEOUT_S)
    return losses(run_dir, [log])


def assert_same_losses(two_hosts: list[float], single: list[float]) -> None:
    assert len(two_hosts) == len(single) == 3
    diffs = [abs(a - b) for a, b in zip(two_hosts, single, strict=True)]
    print(f"single host {single}\ntwo hosts   {two_hosts}\nmax diff    {max(diffs):.3g}")
    assert max(diffs) <= TOL, (two_hosts, single)


@pytest.mark.slow
def test_torchrun_across_two_hosts_matches_one_host(hosts, single_host, small_dataset, tmp_path):
    run_dir = tmp_path / "run"
    args = [*JOB, f"data.path={small_dataset}", f"output.run_dir={run_dir}"]
    common = {
        "NNODES": "2",
        "NPROC": "1",
        "RDZV_ENDPOINT": f"{hosts[0].addr}:{RDZV_PORT}",
        "RDZV_ID": "two-hosts",
        "GLOO_SOCKET_IFNAME": IFACE,
    }
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    procs = [
        start(
            launch("torchrun.sh") + args,
            logs[rank],
            {**common, "NODE_RANK": str(rank), "LOCAL_ADDR": host.addr},
            netns=host.netns,
        )
        for rank, host in enumerate(hosts)
    ]
    wait_all(procs, logs, timeout=TIMEOUT_S)
    assert_same_losses(losses(run_dir, logs), single_host)


@pytest.mark.slow
def test_mpirun_across_two_hosts_matches_one_host(hosts, single_host, small_dataset, tmp_path):
    # hydra's ssh launcher, with a stand-in for ssh: "[options] host command" runs the
    # command in that host's namespace
    cases = "\n".join(f"    {h.addr}) ns={h.netns} ;;" for h in hosts)
    to_host = tmp_path / "netns-ssh"
    to_host.write_text(
        "#!/usr/bin/env bash\n"
        "# ssh stand-in for hydra: run the command inside the namespace of the named host\n"
        "while [[ $1 == -* ]]; do shift; done\nhost=$1\nshift\ncase $host in\n"
        f'{cases}\n    *) echo "unknown host $host" >&2 && exit 255 ;;\nesac\n'
        'exec ip netns exec "$ns" sh -c "$*"\n'
    )
    to_host.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.addr} slots=1\n" for h in hosts))
    run_dir, log = tmp_path / "run", tmp_path / "mpirun.log"
    args = [*JOB, f"data.path={small_dataset}", f"output.run_dir={run_dir}"]
    env = {
        "HOSTFILE": str(hostfile),
        "MASTER_ADDR": hosts[0].addr,
        "GLOO_SOCKET_IFNAME": IFACE,
        "MPIRUN_ARGS": f"-launcher ssh -launcher-exec {to_host} -localhost {hosts[0].addr}",
    }
    proc = start(launch("mpirun.sh") + args, log, env, netns=hosts[0].netns)
    wait_all([proc], [log], timeout=TIMEOUT_S)
    assert_same_losses(losses(run_dir, [log]), single_host)


# ---------------------------------------------------------------------------------------------
# --dry-run: Slurm, SLURM_NODEID, MPIRUN_ARGS

AWKWARD = ["--config", "c.yaml", "output.run_dir=/tmp/a dir/it's", "tag=$HOME"]


def script(name: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REPO / "launch" / name), *args],
        cwd=REPO,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=30,
    )


def split(line: str) -> tuple[dict[str, str], list[str]]:
    """A printed command line -> (leading NAME=value assignments, the command words)."""
    words, env = shlex.split(line), {}
    while words and "=" in words[0] and not words[0].startswith(("/", "-")):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def after(cmd: list[str], word: str) -> list[str]:
    return cmd[cmd.index(word) + 1 :]


def test_slurm_dry_run_prints_the_srun_line_and_every_nodes_torchrun():
    proc = script(
        "slurm.sbatch",
        "--dry-run",
        *AWKWARD,
        SLURM_JOB_NODELIST="gpu[01-02]",
        SLURM_JOB_ID="4242",
        SLURM_GPUS_PER_NODE="h100:8",
        SLURM_CPUS_ON_NODE="96",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    comments = [line for line in lines if line.startswith("#")]
    commands = [split(line) for line in lines if not line.startswith("#")]
    assert len(commands) == 3  # the srun line, then node 0's and node 1's torchrun
    assert "2 nodes (gpu01 gpu02) x 8 ranks" in comments[0]

    env, srun = commands[0]
    assert env == {
        "NNODES": "2",
        "NPROC": "8",
        "RDZV_ENDPOINT": "gpu01:24242",  # the first node; port 20000 + job id mod 10000
        "RDZV_ID": "slurm-4242",
    }
    assert srun[0] == "srun"
    for flag in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=96"):
        assert flag in srun
    assert after(srun, str(REPO / "launch" / "torchrun.sh")) == AWKWARD

    for rank, (env, cmd) in enumerate(commands[1:]):
        assert env["OMP_NUM_THREADS"] == "1"
        assert "--nnodes=2" in cmd and "--nproc-per-node=8" in cmd
        assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=gpu01:24242" in cmd
        assert f"--rdzv-conf=is_host={'true' if rank == 0 else 'false'}" in cmd
        assert after(cmd, "attnres_dist.cli") == ["train", *AWKWARD]
        assert any(f"SLURM_NODEID={rank}, gpu0{rank + 1}" in c for c in comments)


def test_slurm_dry_run_expands_host_lists_and_passes_srun_args():
    proc = script(
        "slurm.sbatch",
        "--dry-run",
        SLURM_JOB_NODELIST="n[8-10],x[01-02]-ib,login",
        NPROC="2",
        RDZV_PORT="31000",
        SRUN_ARGS="--container-image=nvcr.io#me/attnres:1 --container-mounts=/data:/data",
    )
    assert proc.returncode == 0, proc.stderr
    assert "6 nodes (n8 n9 n10 x01-ib x02-ib login) x 2 ranks" in proc.stdout
    srun_line = next(line for line in proc.stdout.splitlines() if line.startswith("NNODES="))
    env, srun = split(srun_line)
    assert env["RDZV_ENDPOINT"] == "n8:31000" and env["RDZV_ID"] == "slurm-0"
    i = srun.index("--container-image=nvcr.io#me/attnres:1")
    assert srun[i + 1] == "--container-mounts=/data:/data"
    assert srun[i + 2] == str(REPO / "launch" / "torchrun.sh")
    assert len([line for line in proc.stdout.splitlines() if "--rdzv-conf=is_host" in line]) == 6


def test_slurm_script_header_and_refusals():
    text = (REPO / "launch" / "slurm.sbatch").read_text()
    directives = [line.split()[1] for line in text.splitlines() if line.startswith("#SBATCH")]
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8"):
        assert directive in directives  # the 2-node x 8-GPU case by default
    proc = script("slurm.sbatch", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("launch/slurm.sbatch:")
    assert "#SBATCH" not in proc.stdout and "--dry-run" in proc.stdout
    proc = script("slurm.sbatch")
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr
    proc = script("slurm.sbatch", "--dry-run")
    assert proc.returncode == 2 and "SLURM_JOB_NODELIST" in proc.stderr


def test_torchrun_takes_node_rank_from_slurm_nodeid():
    # an out-of-range SLURM_NODEID is refused before anything starts, which shows it is read
    proc = script("torchrun.sh", NNODES="2", RDZV_ENDPOINT="h:1", SLURM_NODEID="2")
    assert proc.returncode == 2 and "NODE_RANK=2" in proc.stderr
    proc = script("torchrun.sh", NNODES="2", RDZV_ENDPOINT="h:1", SLURM_NODEID="2", NODE_RANK="5")
    assert proc.returncode == 2 and "NODE_RANK=5" in proc.stderr  # an explicit NODE_RANK wins


def test_mpirun_dry_run_passes_extra_hydra_options(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("gpu-a slots=8\ngpu-b slots=8\n")
    proc = script(
        "mpirun.sh",
        "--dry-run",
        "x=1",
        HOSTFILE=str(hostfile),
        MPIRUN_ARGS="-iface ib0 -launcher ssh",
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    _, cmd = split(line)
    assert cmd[1:6] == ["-iface", "ib0", "-launcher", "ssh", "-hosts"]
    assert cmd[6] == "gpu-a:8,gpu-b:8" and after(cmd, "-np")[0] == "16"
