"""Host reads of tensor values during a training step: the CPU proxy of a step's waits.

On a GPU, reading a tensor's value on the host (``item``, ``bool``, ``float``, ``int``,
``__index__``, ``tolist``) makes the host wait until the device has computed it; a step that
reads nothing lets the host queue the next step's kernels while the device still works. On the
CPU nothing waits, but the reads are the same calls: ``HostReads`` counts them from Python
(torch's function mode sees every call of these methods on a tensor), except reads of one
``allowed`` tensor (a host copy made without waiting, such as ``deferred_skip``'s flag).
"""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset(
    {
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.tolist,
    }
)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values by the reading method's name, but of ``allowed``."""

    def __init__(self, allowed: torch.Tensor | None = None):
        super().__init__()
        self.allowed = allowed
        self.reads: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS and not (args and args[0] is self.allowed):
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def reads_per_step(step, *args, allowed: torch.Tensor | None = None) -> int:
    """Host reads during one call of ``step(*args)`` (its returned loss not read)."""
    with HostReads(allowed) as mode:
        step(*args)
    return sum(mode.reads.values())
