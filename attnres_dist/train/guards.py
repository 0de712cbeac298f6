"""Conditions that stop a run in the middle, each with one line that says what happened.

``TrainingHalted`` is what the command line prints as ``error: <where>: <message>`` and exits
with code 3 (bad input exits with 2 before anything starts; this happens while training).
"""

from __future__ import annotations

import math
from pathlib import Path

from attnres_dist.errors import TrainingHalted


class NonFiniteLoss(TrainingHalted):
    """The training loss became NaN or infinite."""


def check_finite_loss(loss: float, step: int, last_good: tuple[Path, int] | None) -> None:
    """Stop before anything of step ``step`` is saved when its loss is not finite."""
    if math.isfinite(loss):
        return
    if last_good is None:
        where_to = "no checkpoint was saved before it"
    else:
        where_to = f"the last good checkpoint is {last_good[0]} (step {last_good[1]})"
    raise NonFiniteLoss(
        "train",
        f"non-finite loss {loss} at step {step}; training stopped and nothing of this step was "
        f"saved; {where_to}",
    )
