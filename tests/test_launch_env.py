"""Which launcher started this process (``attnres_dist.parallel.launch_env``): the MPI
launchers' variables, the ranks sharing the host, and the address rank 0 announces."""

from __future__ import annotations

import socket

import pytest

from attnres_dist.parallel import launch_env
from attnres_dist.parallel.launch_env import LaunchEnv, detect_launch_env


def test_mpich_environment_is_detected(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert launch_env._mpi_rank_size() == (3, 4, 1)
    monkeypatch.delenv("MPI_LOCALRANKID")
    assert launch_env._mpi_rank_size() == (3, 4, None)  # then derived from host names


def test_master_address_is_loopback_on_one_host_and_routable_across_hosts():
    assert launch_env.master_address("a", ["a", "a"]) == "127.0.0.1"
    # A peer reached through a real interface: the announced address is that interface's,
    # never loopback (host names often resolve to 127.0.1.1 through /etc/hosts).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: routed by the default route, if any
            expected = sock.getsockname()[0]
        except OSError:
            pytest.skip("no default route on this machine")
    if expected.startswith("127."):
        pytest.skip("only loopback routes on this machine")
    assert launch_env.master_address("a", ["a", "192.0.2.1"]) == expected


def test_launchers_say_how_many_ranks_share_the_host(monkeypatch):
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's name
    assert detect_launch_env().local_world_size == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's
    env = detect_launch_env()
    assert (env.launcher, env.local_world_size) == ("torchrun", 4)
    assert LaunchEnv("single", 0, 1, 0, "127.0.0.1", 1).local_world_size is None
