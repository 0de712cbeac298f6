"""Registry records of the GPU kernel implementations: ``triton``, ``fla``, ``flash_attn_res``.

Each record's functions import their module on first call, so importing ``attnres_dist``
never imports Triton, fla-core or flash-attn-res; ``requirement()`` says in one line why an
implementation cannot run here (None when it can).

- ``triton``: the project's own two-phase kernels (:mod:`attnres_dist.ops.triton_two_phase`).
  Runs on CUDA, or on the CPU through Triton's interpreter when ``TRITON_INTERPRET=1``.
- ``fla``: fla-core's fused one-pass kernel ``fused_attnres`` (phase 2 alone).
- ``flash_attn_res``: flash-attn-res's phase-1 / phase-2 kernels (bfloat16 results).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from attnres_dist.ops import DepthAttentionImpl
from attnres_dist.ops.two_phase import check_packed, check_packed_row

TRITON_MODULE = "attnres_dist.ops.triton_two_phase"
OUTSIDE_MODULE = "attnres_dist.ops.outside_kernels"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_requirement() -> str | None:
    if not _installed("triton"):
        return "triton is not installed"
    if torch.cuda.is_available():
        return None
    if not _interpreting():
        return "needs a CUDA device (or TRITON_INTERPRET=1 for Triton's CPU interpreter)"
    from attnres_dist.ops.triton_kernels import interpreter_problem

    problem = interpreter_problem()
    return None if problem is None else f"Triton's CPU interpreter fails here ({problem})"


def _outside_requirement(module: str, package: str, why_cuda: str) -> str | None:
    if not _installed("triton"):
        return "triton is not installed"
    if not _installed(module):
        return f"{package} is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA device ({why_cuda})"
    try:
        importlib.import_module(module)
    except Exception as exc:  # an import-time failure is the reason, whatever its type
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"{package} does not import here: {first}"
    return None


def fla_requirement() -> str | None:
    return _outside_requirement("fla", "fla-core", "fused_attnres refuses CPU tensors")


def flash_attn_res_requirement() -> str | None:
    return _outside_requirement("flash_attn_res", "flash-attn-res", "its kernels run on CUDA only")


def _lazy(module: str, attr: str):
    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{attr}"
    call.__doc__ = f"``{module}.{attr}``, imported on first call."
    return call


def _phases(module: str, phase1: str, phase2: str):
    """The registry's two signatures (packed weights, S outputs) around a kernel module's
    ``phase1(blocks, queries [S, D], gains [S, D], eps) -> (out1 [S, ...], lse [S, ...])`` and
    ``phase2(out1, lse, extra, query [D], gain [D], eps)``, imported on first call."""
    first, second = _lazy(module, phase1), _lazy(module, phase2)

    def packed_phase1(blocks, weights, eps: float = 1e-6):
        check_packed(blocks, weights)
        queries, gains = (t.contiguous() for t in weights.unbind(-2))
        out1, lse = first(blocks, queries, gains, eps)
        return out1.unbind(0), lse.unbind(0)

    def packed_phase2(out1, lse, extra, weights, eps: float = 1e-6):
        check_packed_row(weights, extra.shape[-1])
        query, gain = weights.unbind(0)
        return second(out1, lse, extra, query, gain, eps)

    return packed_phase1, packed_phase2


TRITON = DepthAttentionImpl(
    "triton",
    *_phases(TRITON_MODULE, "phase1", "phase2"),
    devices=("cuda",),
    requirement=triton_requirement,
)
FLA = DepthAttentionImpl(
    "fla",
    phase2=_lazy(OUTSIDE_MODULE, "fla_phase2"),
    devices=("cuda",),
    requirement=fla_requirement,
)
FLASH_ATTN_RES = DepthAttentionImpl(
    "flash_attn_res",
    *_phases(OUTSIDE_MODULE, "flash_attn_res_phase1", "flash_attn_res_phase2"),
    devices=("cuda",),
    requirement=flash_attn_res_requirement,
)
KERNEL_IMPLS = (TRITON, FLA, FLASH_ATTN_RES)
