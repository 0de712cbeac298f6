"""Each local rank on its own cores (``runtime.cpu_binding``, parallel/core_binding.py).

The split is a pure function, checked by hand-written cases; binding changes the affinity of
the calling process, so each case of ``bind_cores`` runs in a child process and reports back
the affinity the kernel then gives it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnres_dist.config import config_from_dict
from attnres_dist.errors import ConfigError
from attnres_dist.parallel.core_binding import cores_for_rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORES = sorted(os.sched_getaffinity(0))


def test_ranks_take_equal_consecutive_shares():
    assert [cores_for_rank(range(8), r, 2) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [cores_for_rank([0, 1], r, 2) for r in range(2)] == [(0,), (1,)]
    # the share is rounded down: with 5 cores and 2 ranks the last core is left to neither
    assert [cores_for_rank(range(5), r, 2) for r in range(2)] == [(0, 1), (2, 3)]
    # the ids the process may use, not 0 .. n - 1 (e.g. under taskset -c 2,3,6,7)
    assert cores_for_rank([7, 2, 6, 3], 1, 2) == (6, 7)


def test_fewer_cores_than_ranks_is_no_share():
    assert cores_for_rank([0, 1], 2, 3) is None
    with pytest.raises(ValueError):
        cores_for_rank([0, 1], 2, 2)


CHILD = """
import json, os, sys
from attnres_dist.parallel.core_binding import bind_cores
from attnres_dist.parallel.launch_env import LaunchEnv
from attnres_dist.errors import ConfigError
args = json.loads(sys.argv[1])
if args["pre_bind"] is not None:
    os.sched_setaffinity(0, args["pre_bind"])
launch = LaunchEnv("torchrun", args["rank"], args["world"], args["rank"], "127.0.0.1", 1,
                   args["local_world"])
try:
    done = list(bind_cores(launch, args["mode"]))
except ConfigError as exc:
    done = ["error", str(exc)]
print(json.dumps({"done": done, "affinity": sorted(os.sched_getaffinity(0))}))
"""


def bind_in_child(mode, rank=0, local_world=2, pre_bind=None, world=None) -> dict:
    args = dict(
        mode=mode, rank=rank, world=world or local_world, local_world=local_world, pre_bind=pre_bind
    )
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_cores_binds_each_local_rank_to_its_share():
    if len(CORES) < 2:
        pytest.skip("needs 2+ cores")
    half = len(CORES) // 2
    for rank in range(2):
        got = bind_in_child(mode="cores", rank=rank)
        mine = CORES[rank * half : (rank + 1) * half]
        assert got["affinity"] == mine
        assert got["done"][0] == "cores"
        assert got["done"][1].startswith(f"local rank {rank}: cores {mine[0]}")
        assert got["done"][1].endswith(" of 2 ranks")


def test_cores_splits_what_an_existing_binding_allows():
    if len(CORES) < 2:
        pytest.skip("needs 2+ cores")
    got = bind_in_child(mode="cores", rank=1, pre_bind=CORES[:2])
    assert got == {"done": ["cores", f"local rank 1: cores {CORES[1]} of 2 ranks"],
                   "affinity": [CORES[1]]}  # fmt: skip


def test_none_never_binds():
    assert bind_in_child(mode="none") == {"done": ["none", "set in config"], "affinity": CORES}


def test_cores_refuses_what_it_cannot_do_in_one_line():
    many = len(CORES) + 1
    got = bind_in_child(mode="cores", local_world=many)
    assert got["done"] == [
        "error",
        f"runtime.cpu_binding: 'cores' with {many} ranks on this host but {len(CORES)} cores "
        "available to them; use none",
    ]
    assert got["affinity"] == CORES
    got = bind_in_child(mode="cores", local_world=None, world=2)
    assert got["done"] == [
        "error",
        "runtime.cpu_binding: 'cores' needs the number of ranks on this host, which torchrun "
        "did not export (LOCAL_WORLD_SIZE); use none",
    ]


def test_default_is_none():
    assert config_from_dict({}).runtime.cpu_binding == "none"


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"runtime": {"cpu_binding": "numa"}})
    assert str(info.value) == "runtime.cpu_binding: got 'numa'; allowed: none, cores"
