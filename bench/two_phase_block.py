"""One block of depth attention: two-phase (torch ops, and the fused C kernels where they
build), lean one-pass, reference one-pass.

A Block AttnRes block of ``S`` sublayers over ``n`` completed blocks (``[n, T, D]``, the
store): sublayer 0 attends over the store, sublayers 1.. over the store plus the partial block.
The two-phase path runs phase 1 once for the S queries and phase 2 per sublayer; the one-pass
paths call the op once per sublayer over the full source list. Full AttnRes is the same with
a group of S sublayers whose phase 2 merges the group's own earlier outputs.

* ``block_timings``: forward + backward time of the block per path, interleaved repetitions
  in alternating order, medians and ratios. Measured as the process's CPU time on one thread:
  on a shared machine wall time swings with other load, and with several threads the CPU
  time would include OpenMP's spin-waiting.
* ``block_io``: bytes read per sublayer and token, measured by counting the inputs of every
  aten op the path executes (:class:`bench.io_counter.OpBytesCounter`), in
  units of ``d`` (one token's hidden vector, float32), next to the paper's Table 1.
"""

from __future__ import annotations

import statistics
import time

import torch

from attnres_dist.ops import get_depth_attention
from attnres_dist.ops.cpu_two_phase import requirement as cpu_kernel_requirement
from bench.io_counter import OpBytesCounter


def _inputs(n: int, size: int, tokens: int, dim: int, seed: int, extra: int = 1):
    gen = torch.Generator().manual_seed(seed)
    store = torch.randn(n, tokens, dim, generator=gen).requires_grad_()
    others = torch.randn(extra, tokens, dim, generator=gen).requires_grad_()
    queries = (0.1 * torch.randn(size, dim, generator=gen)).requires_grad_()
    gains = (1 + 0.1 * torch.randn(size, dim, generator=gen)).requires_grad_()
    grads = torch.randn(size, tokens, dim, generator=gen)
    return store, others, queries, gains, grads


def _block_two_phase(store, partial, queries, gains, full: bool = False, impl="twophase"):
    op = get_depth_attention(impl)
    weights = torch.stack((queries, gains), 1)  # [S, 2, D], as the model packs them
    out1, lse = op.phase1(store, weights)
    outs = [out1[0]]
    for k in range(1, queries.shape[0]):
        extra = partial[:k] if full else partial[:1]
        outs.append(op.phase2(out1[k], lse[k], extra, weights[k]))
    return outs


def _block_one_pass(impl: str, store, partial, queries, gains, full: bool = False):
    op = get_depth_attention(impl)
    blocks = list(store.unbind(0))
    outs = []
    for k in range(queries.shape[0]):
        extra = list(partial[:k].unbind(0)) if full else ([partial[0]] if k else [])
        outs.append(op(queries[k], blocks + extra, gains[k]))
    return outs


PATHS = {
    "two_phase": _block_two_phase,
    "lean": lambda *a, **k: _block_one_pass("lean", *a, **k),
    "reference": lambda *a, **k: _block_one_pass("reference", *a, **k),
    # the fused C kernels, timed where they build (the aten-op counter of ``block_io`` cannot
    # see inside them; they read each input once per pass by construction)
    "two_phase_fused": lambda *a, **k: _block_two_phase(*a, **k, impl="cpu_fused"),
}


def _fwd_bwd(path: str, store, partial, queries, gains, grads) -> float:
    start = time.process_time()
    outs = PATHS[path](store, partial, queries, gains)
    torch.autograd.backward(outs, list(grads))
    return time.process_time() - start


def block_timings(
    n: int, size: int, tokens: int, dim: int, reps: int, warmup: int, seed: int = 0
) -> dict:
    """Median forward + backward ms of one block per path, and the two-phase ratios."""
    args = _inputs(n, size, tokens, dim, seed)
    fused_builds = cpu_kernel_requirement() is None
    names = [name for name in PATHS if name != "two_phase_fused" or fused_builds]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        median = _medians(names, args, reps, warmup)
    finally:
        torch.set_num_threads(threads)
    result = {
        "median_ms": median,
        "threads": 1,
        "clock": "process CPU time",
        "two_phase_over_lean": median["two_phase"] / median["lean"],
        "two_phase_over_reference": median["two_phase"] / median["reference"],
    }
    if "two_phase_fused" in median:
        result["fused_over_two_phase"] = median["two_phase_fused"] / median["two_phase"]
        result["fused_over_lean"] = median["two_phase_fused"] / median["lean"]
    return result


def _medians(names: list[str], args, reps: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        for name in names:
            _fwd_bwd(name, *args)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            samples[name].append(_fwd_bwd(name, *args))
    return {name: 1e3 * statistics.median(v) for name, v in samples.items()}


def _count(fn, tokens: int, dim: int, size: int) -> dict:
    unit = tokens * dim * 4 * size  # d per token, per sublayer
    with OpBytesCounter() as fwd:
        outs = fn()
    with OpBytesCounter() as bwd:
        torch.autograd.backward(outs[0], outs[1])
    return {
        "read_d": fwd.read / unit,
        "written_d": fwd.written / unit,
        "backward_read_d": bwd.read / unit,
    }


def block_io(n: int, size: int, tokens: int, dim: int, seed: int = 0) -> dict:
    """Bytes read and written per sublayer and token (forward; backward reads apart)."""
    store, others, queries, gains, grads = _inputs(n, size, tokens, dim, seed, extra=size)
    partial = others[:1]
    residual_x, residual_f = others[0].detach().requires_grad_(), store[0].detach()

    def run(path, full=False):
        def go():
            outs = PATHS[path](store, others if full else partial, queries, gains, full=full)
            return outs, list(grads)

        return go

    def residual():
        return [residual_x + residual_f], [grads[0]]

    paths = {
        "residual (baseline)": _count(residual, tokens, dim, 1),
        "block two-phase": _count(run("two_phase"), tokens, dim, size),
        "block lean": _count(run("lean"), tokens, dim, size),
        "full two-phase": _count(run("two_phase", full=True), tokens, dim, size),
        "full lean": _count(run("lean", full=True), tokens, dim, size),
    }
    paper = {
        "residual (baseline)": 3.0,
        "block two-phase": n / size + 5,
        "full two-phase": float(size + n),
    }
    return {
        "paths": {k: v | {"paper_table1_d": paper.get(k)} for k, v in paths.items()},
        "tokens": tokens,
        "method": (
            "bytes of the tensor inputs (read) and outputs (written) of every aten op the path "
            "executes, counted by a TorchDispatchMode, divided by tokens x sublayers x 4 D; "
            "views and allocations count nothing"
        ),
    }
