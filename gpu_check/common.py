"""What every step of the GPU check shares: the driver's limit and result file, the device.

The driver (``run``) gives each step its time limit in ``GPU_CHECK_STEP_S`` and the file its
result goes to in ``GPU_CHECK_RESULT``. A long step saves what it has measured so far after each
row, so one cut at its limit still reports it. The step modules (``steps``, ``train_steps``,
``speed_step``, ``step_profile``, ``study_step``) all import from here and never from each
other's entry point, so their imports point one way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def step_limit_s(default: float) -> float:
    """What the driver gives this step (``GPU_CHECK_STEP_S``), else ``default``."""
    return float(os.environ.get("GPU_CHECK_STEP_S", default))


def save_result(result: dict) -> None:
    """Write a step's result, also one so far: a step cut at its time limit then still reports
    what it measured (the driver reads the file whether or not the step finished)."""
    path = os.environ.get("GPU_CHECK_RESULT")
    if path:
        Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")


def on_gpu(dry: bool) -> bool:
    """Whether this step runs on a CUDA device (never in a dry run)."""
    import torch

    return torch.cuda.is_available() and not dry


def dtype_override(dry: bool) -> str:
    """bf16 on the GPU, fp32 in a dry run (as a config override)."""
    return "runtime.dtype=bf16" if on_gpu(dry) else "runtime.dtype=fp32"


def peak_gib() -> float | None:
    """The CUDA allocator's peak since the last ``reset_peak`` (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def reset_peak() -> None:
    """Free what the last row left behind and restart the peak-memory count."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
