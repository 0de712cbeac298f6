"""The project's C kernels for the CPU: built on first use, loaded with ctypes.

The library (``csrc/*.c``: the two-phase depth-attention kernels and RMSNorm) is compiled with
the system C compiler (``$CC`` or ``cc``, ``-O2 -march=native -fopenmp``) into
``$ATTNRES_DIST_KERNEL_CACHE`` (default ``~/.cache/attnres_dist/kernels``), keyed by the
sources, the compiler and the CPU; half a second on a laptop core. Its OpenMP calls resolve to
the libgomp torch has loaded (same soname), so the kernels share torch's threads; callers pass
``torch.get_num_threads()``. :func:`requirement` says why the library cannot be built or loaded
here (None when it can). The helpers below are what every caller of an entry point needs:
pointers, float32 views, casts back, and a call that turns a failed allocation into an error.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / f
    for f in (
        "phase1_fwd_cpu.c",
        "phase1_bwd_cpu.c",
        "merge_cpu.c",
        "merge_norm_cpu.c",
        "rms_norm_cpu.c",
    )
)
HEADERS = tuple(
    CSRC / f for f in ("vector_math.h", "phase1_tile.h", "merge_token.h", "norm_token.h")
)
FLAGS = ("-O2", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
_F, _I, _L, _P = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {  # exported entry points; each returns 0, or -1 out of memory
    # phase 1 takes each query's tensors through arrays of S pointers (``ptrs``)
    # ... then the first query's RMSNorm (its gain or NULL, eps, output, reciprocal RMS)
    "phase1_fwd": (_P, _P, _P, _I, _L, _I, _I, _F, _P, _P, _P, _P, _P, _F, _P, _P, _I),
    # ... then the first query's RMSNorm (gain or NULL, reciprocal RMS, input, gain gradient)
    "phase1_bwd": (*(_P,) * 8, _I, _L, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I),
    "merge1_fwd": (_P, _P, _P, _P, _P, _L, _I, _F, _P, _P, _I),
    "merge1_bwd": (_P, _P, _P, _P, _P, _P, _L, _I, _P, _P, _P, _I, _P, _P, _I),
    "merge_norm_fwd": (_P, _P, _P, _P, _P, _P, _I, _L, _I, _F, _F, _P, _P, _I),
    "merge_norm_bwd": (*(_P,) * 8, _I, _L, _I, _P, _P, _P, _I, _P, _P, _P, _I),
    "merge_fwd": (_P, _P, _P, _P, _P, _I, _L, _I, _F, _P, _P, _I),
    "merge_bwd": (_P, _P, _P, _P, _P, _P, _P, _I, _L, _I, _P, _P, _P, _I, _P, _P, _I),
    "rms_norm_fwd": (_P, _P, _L, _I, _F, _P, _P, _I),
    "rms_norm_bwd": (_P, _P, _P, _P, _L, _I, _P, _P, _I),
    "phase1_lanes": (),  # tokens per tile: the layout of phase 1's saved statistics
}


def cache_dir() -> Path:
    root = os.environ.get("ATTNRES_DIST_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnres_dist/kernels"


def _cpu_model() -> str:
    """The CPU's name and instruction-set flags: ``-march=native`` code must not be loaded on a
    CPU with fewer features (a cache directory shared between machines)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")  # x86, then arm64's names
    return "\n".join(dict.fromkeys(ln for ln in lines if ln.startswith(wanted)))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build() -> Path:
    """The compiled library, built now unless this source, compiler and CPU were built before."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC or install cc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError as exc:
        raise RuntimeError(f"C compiler {cc!r} does not run ({exc.strerror}); set CC") from None
    key = hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in (*SOURCES, *HEADERS)), cc, version, *FLAGS, _cpu_model()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"two_phase_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes building at once never load
    # a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True
        )
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"{cc} failed: {first}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as exc:
        return None, str(exc).strip().splitlines()[0]
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    return lib, None


def requirement() -> str | None:
    """Why the C kernels cannot run here (None when they can)."""
    return _library()[1]


def ptr(t: Tensor | None):
    return None if t is None else t.data_ptr()


def ptrs(tensors) -> ctypes.Array | None:
    """An array of the tensors' data pointers (NULL for None), or None for no tensors."""
    if tensors is None:
        return None
    return (_P * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))


def runs_here(*tensors: Tensor) -> bool:
    """Whether the kernels take these tensors: on the CPU and not float64 (the callers fall back
    to torch otherwise)."""
    return all(t.is_cpu and t.dtype != torch.float64 for t in tensors)


def f32(t: Tensor) -> Tensor:
    """``t`` as a contiguous float32 tensor (itself when it already is one)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def extra_grad(ctx, e: Tensor, needed: bool) -> tuple[Tensor | None, bool, bool]:
    """(where a merge backward writes the extras' gradient, whether that is ``grad_into``'s
    rows, whether the kernel adds to them rather than writing them)."""
    if not needed:
        return None, False, False
    if ctx.grad_into is not None:
        rows, accumulate = ctx.grad_into()
        return rows, True, accumulate
    return torch.empty_like(e), False, False


def lanes() -> int:
    """Tokens per tile of the phase-1 kernels (their vector width): the saved logits are
    ``[ceil(T / lanes), n, S, lanes]`` and the key statistics ``[ceil(T / lanes), n, lanes]``."""
    return _library()[0].phase1_lanes()


def call(name: str, *args) -> None:
    if getattr(_library()[0], name)(*args) != 0:  # the kernels' work buffers (a few KiB)
        raise MemoryError(f"CPU kernel {name}: out of memory")
