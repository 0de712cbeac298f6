"""Peak tensor memory of one call: the most bytes live at once above what was live at its start.

* CUDA: ``torch.cuda.max_memory_allocated`` after a reset of the peak, minus the bytes
  allocated at the start (the caching allocator's own count of live tensor bytes).
* CPU: torch's CPU allocator reports every allocation and free to the profiler
  (``profile_memory=True``); the running sum of those records, in time order, is the live-byte
  count, and its maximum the peak. Unlike the process's RSS high-water mark this is per call,
  so variants that run interleaved in one process are measured apart, and it counts tensors
  only (no allocator caching, no Python objects).

Used by the pipeline benchmark for the peak memory of each stage during one training step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

CPU_METHOD = "torch CPU allocator records (profiler, profile_memory), peak live bytes above start"
CUDA_METHOD = "torch.cuda.max_memory_allocated, peak above start"


def peak_bytes(fn: Callable[[], object], device: str = "cpu") -> tuple[int, str]:
    """(peak bytes above the start, how it was measured) of running ``fn()`` once."""
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, CUDA_METHOD
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    records.sort(key=lambda e: e.start_ns())
    live = itertools.accumulate(e.nbytes() for e in records if e.device_type().name == "CPU")
    return max(live, default=0), CPU_METHOD
