"""The GPU check's ``step_profile`` step: where an AttnRes training step's time goes.

For each (mode, implementation) of ``PROFILE_RUNS`` at the 125M shape: the median step time,
then a ``torch.profiler`` trace over two steps, read three ways:

* the device's busy time and the kernels that took most of it (``_top_ops``): busy time far
  below the wall time means the step waits on the host;
* the host side (``_host_calls``): CUDA runtime calls per step, kernel launches and the calls
  that block the host until the device is done (stream / device / event synchronisation and
  blocking copies), with the host time spent inside them;
* the Python call sites that synchronise (``_sync_sites``): one more step under
  ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every synchronising torch call.

A synchronisation inside the step serialises host and device, so the step costs both times
added instead of the longer one; launches per step set the host's cost when nothing blocks.
On a CPU (the dry run) only the step time and the ops' CPU time are taken.
"""

from __future__ import annotations

import collections
import json
import re
import statistics
import time
import warnings
from pathlib import Path

# (mode, depth-attention implementation), in order of importance: auto's choices first; Full
# with fla last, as it autotunes for each new number of sources (tens of seconds each)
PROFILE_RUNS = (
    ("baseline", "auto"),
    ("block", "fla"),
    ("block", "triton"),
    ("block", "twophase"),
    ("full", "triton"),
    ("full", "fla"),
)
# CUDA runtime / driver calls that block the host until queued work (or a copy) is done
BLOCKING_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous copy (cudaMemcpyAsync is listed on its own)
    "cuStreamSynchronize",
    "cuCtxSynchronize",
)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _top_ops(prof, steps: int, cuda: bool, top: int = 14) -> dict:
    """Per step: the device's busy time and the kernels that took the most of it (on a CPU: the
    ops' self CPU time). Only the device-side kernel events are summed: an op that launches a
    kernel carries that kernel's time as its own ``self_device_time_total`` too, so a sum over
    every event counts each kernel twice."""
    from torch.autograd import DeviceType

    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if cuda:
        events = [e for e in events if e.device_type != DeviceType.CPU]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    busy_us = sum(getattr(e, attr) for e in events)
    rows = [
        {
            "op": e.key[:90],
            "calls": e.count // steps,
            "ms": round(getattr(e, attr) / steps / 1e3, 3),
        }
        for e in events[:top]
    ]
    return {"busy_ms": round(busy_us / steps / 1e3, 2), "top": rows}


def _host_calls(prof, steps: int) -> dict:
    """Per step: CUDA runtime and driver calls on the host (``cudaX`` / ``cuX``; not device
    kernels such as ``cudnn_...``), kernel launches among them, and the blocking calls (count
    and host milliseconds inside them, by name)."""
    from torch.autograd import DeviceType

    runtime = [
        e
        for e in prof.key_averages()
        if e.device_type == DeviceType.CPU and re.match(r"cu(da)?[A-Z]", e.key)
    ]
    blocking = {
        e.key: {"calls": e.count / steps, "ms": round(e.cpu_time_total / steps / 1e3, 3)}
        for e in runtime
        if e.key in BLOCKING_CALLS
    }
    return {
        "runtime_calls": round(sum(e.count for e in runtime) / steps, 1),
        "launches": round(sum(e.count for e in runtime if e.key in LAUNCH_CALLS) / steps, 1),
        "memcpy_async": round(sum(e.count for e in runtime if e.key == "cudaMemcpyAsync") / steps),
        "blocking": blocking,
        "blocking_ms": round(sum(b["ms"] for b in blocking.values()), 3),
    }


def _sync_sites(engine, batch, top: int = 8) -> dict:
    """One step (``engine.train_step(batch)``) with torch's CUDA sync debug mode on: how many
    torch calls synchronised, and the Python lines that made them (the warning's location),
    most frequent first."""
    import torch

    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_step(batch)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {"syncs": len(syncs), "sites": [f"{s} x{n}" for s, n in sites.most_common(top)]}


def _guarded(read, *args) -> dict:
    try:
        return read(*args)
    except Exception as exc:  # reported in the row, never fatal to the step
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def step_profile(work: Path, dry: bool) -> dict:
    """Where the AttnRes step's extra time goes at the 125M shape: each (mode, implementation)
    of PROFILE_RUNS timed (median of 5 steps), profiled over 2 steps and, on a GPU, run once
    more under the sync debug mode. Rows are saved as they finish; stops at the step's limit."""
    from torch.profiler import ProfilerActivity, profile

    from gpu_check.common import on_gpu, save_result, step_limit_s
    from gpu_check.train_steps import shape_label, step_seconds, trainer_125m

    deadline = time.monotonic() + step_limit_s(240) - 30
    cuda = on_gpu(dry)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    warmup, reps, profiled = (3, 5, 2) if cuda else (1, 2, 1)
    rows = []
    for mode, impl in PROFILE_RUNS:
        if time.monotonic() > deadline:
            rows.append({"mode": mode, "impl": impl, "skipped": "the step's time limit"})
            continue
        extra = (f"model.attnres.mode={mode}", f"model.attnres.impl={impl}")
        try:
            run_name = f"profile-{mode}-{impl}"
            steps = warmup + reps + profiled + 1
            trainer = trainer_125m(work, dry, run_name, steps, *extra)
        except Exception as exc:  # an implementation this machine cannot run
            rows.append({"mode": mode, "impl": impl, "skipped": f"{exc}"[:200]})
            continue
        times = step_seconds(trainer, warmup, reps)
        first = warmup + reps
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for step in range(first, first + profiled):
                trainer.engine.train_step(trainer.micro_batches(step))
            wall_ms = 1e3 * (time.perf_counter() - start) / profiled
        row = {"mode": mode, "impl": impl, "step_ms": round(1e3 * statistics.median(times), 2)}
        row |= {"profiled_wall_ms": round(wall_ms, 2), **_top_ops(prof, profiled, cuda)}
        if cuda:  # neither reading may cost the row its step time
            row["host"] = _guarded(_host_calls, prof, profiled)
            batch = trainer.micro_batches(first + profiled)
            row["sync"] = _guarded(_sync_sites, trainer.engine, batch)
        print("profile", json.dumps(row), flush=True)
        rows.append(row)
        save_result(
            {"shape": shape_label(dry), "runs": rows, "cut": "stopped at the step's time limit"}
        )
        del trainer, prof
    return {"shape": shape_label(dry), "runs": rows}
