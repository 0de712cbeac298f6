"""Run pipeline schedules' instruction streams on real gloo p2p (``pipeline/schedule_exec.py``).

    torchrun --nproc_per_node=P tests/workers/schedule_exec_case.py OUT CASE [CASE ...]

CASE is ``name:V:M:forward_ms:backward_ms[:flag...]`` with name 1f1b | dualpipev | interleaved.
Every message's shape is that of its hand-over, ``[c + 2, 3]`` for chunk c -> c + 1, so no two
transitions share a shape (gloo itself rejects a message of the wrong size); flag ``uniform``
gives every transition the shape ``[2, 3]``, so only the contents tell messages apart. Flag
``swap`` exchanges, on rank 0, the first queued activation and gradient that go to the same
peer in one commit (a schedule bug the run must catch). Rank 0 writes OUT (JSON): per case,
every rank's ``ExecResult`` and the measured bubble.
"""

import json
import sys
from datetime import timedelta

import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds

from attnres_dist.pipeline.schedule_exec import build_schedule, execute, measured_bubble


def shape_of(chunk: int) -> tuple[int, int]:
    return (chunk + 2, 3)


def uniform_shape(chunk: int) -> tuple[int, int]:
    return (2, 3)


def swapped(schedule):
    """The stream with the first commit's activation and gradient sends (same peer) swapped."""
    steps = [list(step) for step in schedule]
    for step in steps:
        sends = [i for i, c in enumerate(step) if isinstance(c, ds.SendActivation | ds.SendGrad)]
        if len({type(step[i]) for i in sends}) == 2:
            a = next(i for i in sends if isinstance(step[i], ds.SendActivation))
            b = next(i for i in sends if isinstance(step[i], ds.SendGrad))
            step[a], step[b] = step[b], step[a]
            return steps
    raise SystemExit("no commit sends an activation and a gradient together")


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    # the project's own limit (parallel.timeout_s): 4 ranks on 2 cores shared with other work
    # can leave a rank unscheduled for minutes; a hang still ends, at pytest's timeout
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, P = dist.get_rank(), dist.get_world_size()
    report = []
    for case in cases:
        name, V, M, fwd_ms, bwd_ms, *flags = case.split(":")
        V, M = int(V), int(M)
        schedule, chunk_of, C, phased = build_schedule(name, P, rank, M, V)
        # built before the barrier: the interleaved order imports Megatron on first use
        schedule = swapped(schedule) if "swap" in flags and rank == 0 else list(schedule)
        dist.barrier()
        result = execute(
            schedule,
            rank,
            chunk_of,
            C,
            M,
            uniform_shape if "uniform" in flags else shape_of,
            float(fwd_ms) / 1e3,
            float(bwd_ms) / 1e3,
            phased,
        )
        gathered = [None] * P if rank == 0 else None
        dist.gather_object(result.to_dict(), gathered, dst=0)
        if rank == 0:
            report.append(
                {"case": case, "C": C, "ranks": gathered, "bubble": measured_bubble(gathered)}
            )
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
