"""The one rule for which device a tensor handed to torch.distributed lives on.

NCCL moves only CUDA tensors and gloo only CPU ones, so a tensor built for a collective or a
point-to-point message must be created on the run's device, never on torch's default (the CPU):
under NCCL a CPU tensor raises before the first step. The run's device is declared once, by
``init_distributed`` right after it binds this process to its GPU: ``cuda:<local GPU>`` for a
GPU run (its process group is NCCL), ``cpu`` otherwise (gloo). DeepSpeed's accelerator
names the same device (``get_accelerator().current_device_name()``); the pipeline engine
checks that its engine agrees.

Code that makes a tensor only to communicate it writes ``torch.zeros(..., device=comm_device())``.
Tensors that are already the model's (parameters, gradients, optimizer state, activations) live
on the run's device by construction. Object collectives (``gather_object`` and friends) pick
their device themselves from the bound GPU. ``parallel/comm_check.py`` verifies all of this on a
CPU-only machine (tests/test_comm_device.py).
"""

from __future__ import annotations

import torch

_declared: torch.device | None = None


def default_device() -> torch.device:
    """The device a run on this machine uses: the bound GPU if CUDA is visible, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def declare(device: str | torch.device | None = None) -> torch.device:
    """Fix the run's device (``None``: ``default_device()``); returns it."""
    global _declared
    _declared = torch.device(device) if device is not None else default_device()
    return _declared


def comm_device() -> torch.device:
    """The device of every tensor this process creates for torch.distributed."""
    return _declared if _declared is not None else default_device()


def synchronize() -> None:
    """Wait for queued work on the run's device (timing NCCL calls, which return early)."""
    device = comm_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
