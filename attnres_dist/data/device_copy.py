"""Token batches onto the run's device without making the host wait for it.

A host-to-GPU copy from ordinary (pageable) memory returns only when the copy is done, and the
copy runs on the stream behind all the work queued before it: the host then waits for the
previous step's GPU work at the start of every step, and cannot run ahead to queue the next.
From pinned (page-locked) memory the copy is queued like a kernel (``non_blocking``) and the
host goes on; torch's caching host allocator keeps the pinned buffer until the copy is done.
The engines copy all micro-batches of a step this way before the step's first forward. On a
CPU run this is ``Tensor.to`` (nothing to copy).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; host to GPU through pinned memory, without waiting."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
