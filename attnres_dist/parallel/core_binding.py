"""Each rank of a multi-process CPU run on cores of its own (``runtime.cpu_binding=cores``).

The local ranks split the cores this process may use (its affinity, so within whatever
taskset, numactl or Slurm allowed) into equal consecutive shares, local rank ``r`` taking share
``r``; the process's main thread is bound before the process group starts, so the threads
created after it (gloo's, the autograd engine's, the intra-op pool) inherit its share. It is
DeepSpeed launcher's ``--bind_cores_to_rank`` (numactl) for every launcher, which keeps ranks
and their communication threads from migrating between cores (and, on a multi-socket host,
between memory nodes).

``none`` (the default) leaves placement to the scheduler: on the project's 2-core machine
``make bench``'s ``pipeline_binding.json`` (a pp = 2 step, bound and unbound jobs alternating)
measured no gain from binding, unbound / bound 0.98-1.06 in two runs.

:func:`cores_for_rank` is the split alone (a pure function); :func:`bind_cores` applies it
and returns what it did with the reason, for the start-up log.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from attnres_dist.errors import ConfigError
from attnres_dist.parallel.launch_env import LaunchEnv

FIELD = "runtime.cpu_binding"
_bound: tuple[str, str] | None = None  # what this process bound itself to (binding is per process)


def cores_for_rank(
    available: Sequence[int], local_rank: int, local_world_size: int
) -> tuple[int, ...] | None:
    """Local rank ``local_rank``'s share of the core ids ``available``: ``len(available) //
    local_world_size`` consecutive ones, in order; None when there are fewer cores than ranks."""
    cores = sorted(available)
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} of {local_world_size}")
    share = len(cores) // local_world_size
    if share == 0:
        return None
    return tuple(cores[local_rank * share : (local_rank + 1) * share])


def bind_cores(launch: LaunchEnv, mode: str) -> tuple[str, str]:
    """Apply ``mode`` to this process; return ``(what was done, why)``. Once bound, a process
    stays bound: later calls (several engines in one process) return the same."""
    global _bound
    if mode == "none":
        return "none", "set in config"
    if _bound is not None:
        return _bound
    local = launch.local_world_size
    if local is None:
        raise ConfigError(
            FIELD,
            f"'cores' needs the number of ranks on this host, which {launch.launcher} did "
            "not export (LOCAL_WORLD_SIZE); use none",
        )
    available = os.sched_getaffinity(0)
    cores = cores_for_rank(available, launch.local_rank, local)
    if cores is None:
        raise ConfigError(
            FIELD,
            f"'cores' with {local} ranks on this host but {len(available)} cores available "
            "to them; use none",
        )
    os.sched_setaffinity(0, cores)
    _bound = ("cores", f"local rank {launch.local_rank}: cores {_spans(cores)} of {local} ranks")
    return _bound


def _spans(cores: Sequence[int]) -> str:
    """``0-3,8`` for (sorted) cores 0, 1, 2, 3, 8."""
    out, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            out.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(out)
