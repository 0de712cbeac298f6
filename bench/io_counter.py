"""Count the bytes every aten op reads and writes, by intercepting the ops themselves.

Owns :class:`OpBytesCounter`, a ``TorchDispatchMode``: inside it, every aten op that runs
(including those inside custom autograd functions and BLAS calls made through aten) adds the
bytes of its tensor inputs to ``read`` and of its tensor outputs to ``written``. A tensor's
bytes are those of its own elements (``numel * element_size``), not of the storage it views.
Metadata-only ops (views, ``detach``, ``empty``, ...) read and write nothing and are skipped,
so the counts are the memory traffic of an unfused execution: an upper bound on what a fused
kernel that keeps intermediates in registers would move. ``calls`` counts every aten call,
views included (the per-op overhead a step pays on CPU).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_NO_TRAFFIC = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "permute",
    "transpose",
    "t",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "narrow",
    "as_strided",
    "alias",
    "detach",
    "unbind",
    "split",
    "empty",
    "empty_like",
    "empty_strided",
    "set_",
    "lift_fresh",
    "_reshape_alias",
}


def _tensor_bytes(tree) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class OpBytesCounter(TorchDispatchMode):
    """Bytes read (op inputs) and written (op outputs) by the aten ops run in the context."""

    def __init__(self):
        super().__init__()
        self.read = 0
        self.written = 0
        self.ops: Counter[str] = Counter()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls += 1
        if name.rstrip("_") not in _NO_TRAFFIC and name not in _NO_TRAFFIC:
            self.read += _tensor_bytes((args, kwargs))
            self.written += _tensor_bytes(out)
            self.ops[name] += 1
        return out
