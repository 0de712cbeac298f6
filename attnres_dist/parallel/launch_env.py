"""Which launcher started this process, and where rank 0 listens.

Three launchers are supported, plus a plain single process:

* ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set;
  ``TORCHELASTIC_RUN_ID`` tells it apart.
* ``deepspeed``: the same variables, plus ``--local_rank=N`` on the command line (accepted by
  the CLI and ignored in favour of ``LOCAL_RANK``).
* ``mpirun`` (mpi4py with the mpich wheel): ``PMI_RANK``/``PMI_SIZE`` or Open MPI's
  ``OMPI_COMM_WORLD_*``; rank 0 picks a free port and broadcasts its address and port over MPI,
  so no rendezvous variables are needed.
* none: world size 1 on a free loopback port.

Everything here reads the environment only; nothing starts a process group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # torchrun | deepspeed | mpirun | single
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    # ranks on this host, where the launcher says (or, under MPI, the gathered host names do)
    local_world_size: int | None = None

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value is None else int(value)


def _mpi_rank_size() -> tuple[int, int, int | None] | None:
    """Rank, size and (when the launcher says) local rank from an MPI launcher's environment.

    MPICH's hydra sets ``PMI_RANK``, ``PMI_SIZE`` and ``MPI_LOCALRANKID`` (checked with the
    ``mpich`` wheel, 5.0); Open MPI sets ``OMPI_COMM_WORLD_*``; PMIx launchers ``PMIX_*``.
    """
    for rank_key, size_key, local_key in (
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ):
        if rank_key in os.environ and size_key in os.environ:
            local = os.environ.get(local_key)
            return (
                int(os.environ[rank_key]),
                int(os.environ[size_key]),
                None if local is None else int(local),
            )
    return None


def detect_launch_env() -> LaunchEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed"
        return LaunchEnv(
            launcher=launcher,
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            # torchrun's name, then the deepspeed launcher's
            local_world_size=_optional_int("LOCAL_WORLD_SIZE") or _optional_int("LOCAL_SIZE"),
        )
    mpi = _mpi_rank_size()
    if mpi is not None and mpi[1] > 1:
        return _from_mpi(mpi[2])
    return LaunchEnv("single", 0, 1, 0, "127.0.0.1", free_port(), local_world_size=1)


def _from_mpi(local_rank: int | None) -> LaunchEnv:
    """Rank 0 chooses the rendezvous endpoint and broadcasts it over MPI.

    Every rank's host name is gathered first: it tells rank 0 whether the job spans hosts
    (then loopback will not do) and which peer to route to, and gives each rank its local rank
    when the launcher did not export one.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    host = socket.gethostname()
    hosts = comm.allgather(host)
    if local_rank is None:
        local_rank = hosts[:rank].count(host)
    endpoint = None
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or master_address(host, hosts)
        port = int(os.environ.get("MASTER_PORT") or free_port())
        endpoint = (addr, port)
    addr, port = comm.bcast(endpoint, root=0)
    local_world_size = hosts.count(host)
    return LaunchEnv("mpirun", rank, comm.Get_size(), local_rank, addr, port, local_world_size)


def master_address(host: str, hosts: list[str]) -> str:
    """The address rank 0 (on ``host``) announces to ranks on ``hosts``.

    Loopback when every rank shares the host. Otherwise the source address of this host's
    route to another rank's host: the host name's own address is unreliable, since many
    distributions map it to 127.0.1.1 in /etc/hosts.
    """
    peers = [h for h in hosts if h != host]
    if not peers:
        return "127.0.0.1"
    for peer in dict.fromkeys(peers):
        addr = _route_source(peer)
        if addr is not None:
            return addr
    return _routable_address()


def _route_source(peer: str) -> str | None:
    """This host's address on the route to ``peer`` (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((socket.gethostbyname(peer), 9))
            addr = sock.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def _routable_address() -> str:
    """This host's address as its host name resolves; loopback when it does not resolve.

    Multi-host jobs whose host names do not resolve to the right interface set MASTER_ADDR.
    """
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def export_torch_env(launch: LaunchEnv) -> None:
    """Make the standard torch.distributed variables agree with ``launch`` (for DeepSpeed)."""
    os.environ.update(
        RANK=str(launch.rank),
        WORLD_SIZE=str(launch.world_size),
        LOCAL_RANK=str(launch.local_rank),
        MASTER_ADDR=launch.master_addr,
        MASTER_PORT=str(launch.master_port),
    )
