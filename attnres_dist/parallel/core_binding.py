"""Each rank of a multi-process CPU run on cores of its own (``runtime.cpu_binding``).

The local ranks split the cores this process may use into equal consecutive shares, local
rank ``r`` taking share ``r``; the process's main thread is bound before the process group
starts, so the threads created after it (gloo's, the autograd engine's, the intra-op pool)
inherit its share. Left to the scheduler, the ranks of a pipeline and their communication
threads migrate between cores and lose each core's cache: ``make bench``'s
``pipeline_binding.json`` measures a pp = 2 step of the tiny model unbound / bound (in jobs that
alternate, since a process cannot switch). DeepSpeed's launcher offers the same as
``--bind_cores_to_rank`` (numactl); this works under every launcher.

* ``auto``: bind on a CPU run with more than one rank on this host, when at least as many
  cores as local ranks are available and nothing bound the process already (its affinity is
  every online core: no taskset, numactl, Slurm ``--cpu-bind`` or launcher binding);
* ``cores``: bind wherever the shares can be formed (a ``ConfigError`` otherwise);
* ``none``: leave placement to the scheduler (e.g. when other jobs share the machine's cores).

:func:`cores_for_rank` is the split alone (a pure function); :func:`bind_cores` applies it
and returns the choice with its reason, for the start-up log.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from attnres_dist.errors import ConfigError
from attnres_dist.parallel.launch_env import LaunchEnv

MODES = ("auto", "cores", "none")
FIELD = "runtime.cpu_binding"
_bound: tuple[str, str] | None = None  # what this process bound itself to (binding is per process)


def cores_for_rank(
    available: Sequence[int], local_rank: int, local_world_size: int
) -> tuple[int, ...] | None:
    """Local rank ``local_rank``'s share of ``available`` (sorted core ids): ``len(available)
    // local_world_size`` consecutive cores; None when there are fewer cores than ranks."""
    cores = sorted(available)
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} of {local_world_size}")
    share = len(cores) // local_world_size
    if share == 0:
        return None
    return tuple(cores[local_rank * share : (local_rank + 1) * share])


def _online_cores() -> int:
    return os.cpu_count() or 1


def bind_cores(launch: LaunchEnv, mode: str, on_gpu: bool) -> tuple[str, str]:
    """Apply ``mode`` to this process; return ``(what was done, why)``. Once bound, a process
    stays bound: later calls (several engines in one process) return the same."""
    global _bound
    if mode != "none" and _bound is not None:
        return _bound
    if mode == "none":
        return "none", "set in config"
    if mode == "auto" and on_gpu:
        return "none", "GPU run"
    local = launch.local_world_size
    if local is None:
        if mode == "cores":
            raise ConfigError(
                FIELD,
                f"'cores' needs the number of ranks on this host, which {launch.launcher} did "
                "not export (LOCAL_WORLD_SIZE); use auto or none",
            )
        return "none", f"{launch.launcher} did not say how many ranks share this host"
    if mode == "auto" and local < 2:
        return "none", "one rank on this host"
    available = sorted(os.sched_getaffinity(0))
    if mode == "auto" and len(available) < _online_cores():
        return "none", f"already bound to {_spans(available)}"
    cores = cores_for_rank(available, launch.local_rank, local)
    if cores is None:
        if mode == "cores":
            raise ConfigError(
                FIELD,
                f"'cores' with {local} ranks on this host but {len(available)} cores "
                "available to them; use auto or none",
            )
        return "none", f"{local} ranks on this host share {len(available)} cores"
    os.sched_setaffinity(0, cores)
    why = "set in config" if mode == "cores" else f"{local} ranks on {len(available)} cores"
    _bound = ("cores", f"local rank {launch.local_rank}: cores {_spans(cores)}; {why}")
    return _bound


def _spans(cores: Sequence[int]) -> str:
    """``0-3,8`` for cores 0, 1, 2, 3, 8."""
    out, start = [], None
    cores = sorted(cores)
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            out.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(out)
