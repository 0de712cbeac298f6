"""Test-only fault injection: one rank dies or stalls at a chosen point of training, once.

Crash safety and elastic restart can only be tested by really crashing, so the trainer and
the checkpoint writer call ``maybe_fail(point, rank, step)`` at a few points. It does nothing
unless the environment says so::

    ATTNRES_FAULT=<action>:<point>:<rank>:<step>[:<marker file>]

``action`` is ``kill`` (SIGKILL: no cleanup, no exception handler, like a lost node) or
``stall`` (sleep for an hour, like a hung neighbour). ``point`` is ``before-step`` (step
``step`` is about to run), ``after-step`` (it finished, checkpoint included) or ``mid-save``
(this rank has written its part of step ``step``'s checkpoint, nothing is committed yet).
With a marker file the fault fires only if the file does not exist yet and creates it first,
so a job restarted by its launcher does not fail again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV = "ATTNRES_FAULT"
POINTS = ("before-step", "after-step", "mid-save")


def maybe_fail(point: str, rank: int, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split(":", 4)
    if len(parts) < 4:
        raise ValueError(f"{ENV}={spec!r}: expected action:point:rank:step[:marker]")
    action, where, fault_rank, fault_step = parts[:4]
    if where not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown point {where!r} ({', '.join(POINTS)})")
    if where != point or int(fault_rank) != rank or int(fault_step) != step:
        return
    if len(parts) == 5:
        marker = Path(parts[4])
        try:
            with open(marker, "x"):
                pass
        except FileExistsError:
            return
    print(f"fault injection: {action} rank {rank} at {point} of step {step}", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stall":
        time.sleep(3600)
    else:
        raise ValueError(f"{ENV}={spec!r}: unknown action {action!r} (kill or stall)")
