"""The numbers logged with every training step besides the loss: throughput, MFU, peak memory.

``StepSignals`` turns a logging window (tokens, seconds) into tokens/s and model FLOPs
utilisation (``train/flops.py``: FLOPs per token, including the depth attention, over the peak
of every device of the run), and gathers each rank's peak memory to every rank: CUDA's
``max_memory_allocated`` on a GPU, the process's peak resident set size on a CPU. The gather is
a collective, so every rank calls ``record`` at the same steps; its tensor lives on the run's
device (what the engine computes on), as NCCL requires.
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

from attnres_dist.train.flops import known_peak_tflops, mfu, training_flops_per_token


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory on ``device``: allocated CUDA memory, or peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def gather_peak_memory(device: torch.device) -> list[int]:
    """Every rank's peak memory in bytes, in rank order (collective when distributed)."""
    mine = peak_memory_bytes(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    local = torch.tensor([mine], dtype=torch.int64, device=device)
    every = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    return [int(t.item()) for t in every]


def resolve_peak_tflops(configured: float | None, device: torch.device) -> float | None:
    """``train.peak_tflops``, else a known GPU's dense bf16 peak, else None (no MFU)."""
    if configured is not None:
        return float(configured)
    if device.type == "cuda":
        return known_peak_tflops(torch.cuda.get_device_name(device))
    return None


class StepSignals:
    def __init__(self, model_cfg, vocab_size: int, devices: int, device, peak_tflops=None):
        self.flops = training_flops_per_token(model_cfg, vocab_size)
        self.devices = int(devices)
        self.device = torch.device(device)
        self.peak_tflops = resolve_peak_tflops(peak_tflops, self.device)

    def record(self, tokens: int, seconds: float) -> dict:
        """tokens/s, MFU (when a peak is known) and per-rank peak memory of one window."""
        tps = tokens / max(seconds, 1e-9)
        peaks = gather_peak_memory(self.device)
        out = {
            "tokens_per_s": tps,
            "model_tflops_per_s": self.flops.total * tps / 1e12,
            "peak_memory_mb": round(max(peaks) / 2**20, 1),
            "peak_memory_mb_per_rank": [round(p / 2**20, 1) for p in peaks],
        }
        if self.peak_tflops is not None:
            out["mfu"] = mfu(self.flops.total, tps, self.devices, self.peak_tflops)
        return out
