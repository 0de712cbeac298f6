"""What this machine offers for the fast paths: one probe per capability.

Each probe answers ``Probe(ok, detail)``: ``detail`` is what was found (a device name, a
version) or why not (the import error), so the start-up report can say why a path was or was
not taken. Probes import the compiled extension behind each fast path, not only its Python
package: PyPI's ``apex`` is an unrelated web toolkit, and an apex or Transformer Engine built
without its CUDA extensions imports fine but fails on first use. The selection logic
(``attnres_dist.runtime.select``) calls these through the module, so tests can replace them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Probe:
    ok: bool
    detail: str


def _import_error(what: str, exc: BaseException) -> Probe:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return Probe(False, f"{what} not importable ({text})")


def cuda() -> Probe:
    """A CUDA device this process can use."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return Probe(False, "torch is a CPU-only build")
        return Probe(False, "no CUDA device visible")
    return Probe(True, torch.cuda.get_device_name(torch.cuda.current_device()))


def bf16() -> Probe:
    """bf16 arithmetic on the current CUDA device (compute capability 8.0+)."""
    if not torch.cuda.is_available():
        return Probe(False, "no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    if not torch.cuda.is_bf16_supported():
        return Probe(False, f"GPU compute capability {major}.{minor} has no bf16 support")
    return Probe(True, f"GPU compute capability {major}.{minor}")


def transformer_engine() -> Probe:
    """Transformer Engine's PyTorch modules, as Megatron-Core's TE layer spec imports them."""
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # ImportError, or OSError from a missing CUDA library
        return _import_error("transformer_engine", exc)
    return Probe(True, f"transformer_engine {getattr(te, '__version__', '(unknown version)')}")


def apex_norm() -> Probe:
    """apex's fused RMSNorm, with the CUDA extension it dispatches to."""
    try:
        importlib.import_module("apex.normalization").FusedRMSNorm  # noqa: B018
        importlib.import_module("fused_layer_norm_cuda")
    except Exception as exc:
        return _import_error("apex FusedRMSNorm", exc)
    return Probe(True, "apex FusedRMSNorm")


def apex_adam() -> Probe:
    """apex's FusedAdam, with the multi-tensor CUDA extension (amp_C) its step needs."""
    try:
        importlib.import_module("apex.optimizers").FusedAdam  # noqa: B018
        importlib.import_module("amp_C")
    except Exception as exc:
        return _import_error("apex FusedAdam", exc)
    return Probe(True, "apex FusedAdam")


def cpu_kernels() -> Probe:
    """The project's C kernels (``attnres_dist.ops.cpu_library``), built or loaded here."""
    from attnres_dist.ops.cpu_library import requirement

    why_not = requirement()
    if why_not is not None:
        return Probe(False, f"the C kernels cannot be built here ({why_not})")
    return Probe(True, "the project's fused C RMSNorm")


def glibc_malloc() -> Probe:
    """glibc's ``malloc`` and its ``mallopt``, which ``runtime.cpu_allocator=retain`` sets."""
    from attnres_dist.runtime.allocator import glibc

    libc, detail = glibc()
    return Probe(libc is not None, detail)
