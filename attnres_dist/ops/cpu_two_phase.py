"""Two-phase depth attention on the CPU through the project's fused C kernels (``cpu_fused``).

Same math and signatures as :mod:`attnres_dist.ops.two_phase`; phase 1 and phase 2 run as one
C loop per token (``csrc/phase1_cpu.c``, ``csrc/merge_cpu.c``), forward and backward, where the
torch ops read every block about ten times and dispatch ~30 small ops per pass. Sources are
computed in float32 (bfloat16 / float16 ones are upcast as in the torch ops); float64 inputs
and tensors off the CPU take the torch-ops path. Phase 2 merges one extra source (the Block
partial) by a two-way softmax and several (Full AttnRes's group outputs) by the general
online-softmax merge, both fused.

The kernel library is compiled on first use with the system C compiler (``$CC`` or ``cc``,
``-O2 -march=native -fopenmp``) into ``$ATTNRES_DIST_KERNEL_CACHE`` (default
``~/.cache/attnres_dist/kernels``), keyed by the source, the compiler and the CPU, and loaded
with ctypes; half a second on a laptop core. Its OpenMP calls resolve to the libgomp torch has
loaded (same soname), so the kernels share torch's threads; they use ``torch.get_num_threads()``.
:func:`requirement` says why the library cannot be built or loaded here (None when it can).
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
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnres_dist.ops import two_phase
from attnres_dist.ops.depth_attention import one_pass_adapter

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "phase1_cpu.c", CSRC / "merge_cpu.c")  # and the header they share
HEADERS = (CSRC / "vector_math.h",)
FLAGS = ("-O2", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared")
_F, _I, _L, _P = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {  # exported entry points; each returns 0, or -1 out of memory
    "phase1_fwd": (_P, _P, _P, _I, _L, _I, _I, _F, _P, _P, _P, _P, _I),
    "phase1_bwd": (_P, _P, _P, _P, _P, _P, _P, _P, _I, _L, _I, _I, _P, _I, _P, _P, _I),
    "merge1_fwd": (_P, _P, _P, _P, _P, _L, _I, _F, _P, _P, _I),
    "merge1_bwd": (_P, _P, _P, _P, _P, _P, _L, _I, _P, _P, _P, _I, _P, _P, _I),
    "merge_fwd": (_P, _P, _P, _P, _P, _I, _L, _I, _F, _P, _P, _I),
    "merge_bwd": (_P, _P, _P, _P, _P, _P, _P, _I, _L, _I, _P, _P, _P, _I, _P, _P, _I),
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
    """Why the fused CPU kernels cannot run here (None when they can)."""
    return _library()[1]


def _ptr(t: Tensor | None):
    return None if t is None else t.data_ptr()


def _runs_here(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype != torch.float64 for t in tensors)


def _f32(t: Tensor) -> Tensor:
    """``t`` as a contiguous float32 tensor (itself when it already is one)."""
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _call(name: str, *args) -> None:
    if getattr(_library()[0], name)(*args) != 0:  # the kernels' work buffers (a few KiB)
        raise MemoryError(f"cpu_fused {name}: out of memory")


def _param_grads(query: Tensor, norm_weight: Tensor, need_q: bool, need_g: bool):
    """Buffers the kernels write dL/d query and dL/d gain into (float32), or None."""
    gq = torch.empty(query.shape) if need_q else None
    gg = torch.empty(norm_weight.shape) if need_g else None
    return gq, gg


def _merge_grads(grads, inputs) -> tuple:
    """A merge backward's return: each float32 gradient (or None) in its input's dtype (an
    input given as a dtype stands for itself), and None for ``eps`` and ``grad_into``."""
    out = []
    for grad, ref in zip(grads, inputs, strict=True):
        dtype = ref if isinstance(ref, torch.dtype) else ref.dtype
        out.append(None if grad is None else _cast(grad, dtype))
    return (*out, None, None)


def _extra_grad(ctx, e: Tensor, needed: bool) -> tuple[Tensor | None, bool]:
    """(where a merge backward writes the extras' gradient, whether it adds to ``grad_into``)."""
    if not needed:
        return None, False
    if ctx.grad_into is not None:
        return ctx.grad_into(), True
    return torch.empty_like(e), False


class _Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, blocks, queries, norm_weights, eps, grad_into):
        n, dim, s = blocks.shape[0], blocks.shape[-1], queries.shape[0]
        batch = blocks.shape[1:-1]
        b, q, g = _f32(blocks), _f32(queries), _f32(norm_weights)
        tokens = b.numel() // (n * dim)
        out1, lse = b.new_empty(s, *batch, dim), b.new_empty(s, *batch)
        logits, rstd = b.new_empty(tokens, n, s), b.new_empty(tokens, n)
        _call(
            "phase1_fwd", _ptr(b), _ptr(q), _ptr(g), n, tokens, dim, s, eps, _ptr(out1),
            _ptr(lse), _ptr(logits), _ptr(rstd), torch.get_num_threads(),
        )  # fmt: skip
        # logits and key statistics (S / D and 1 / D of the blocks' size): the backward then
        # reads each block row once, for its products with the output gradient
        ctx.save_for_backward(blocks, queries, norm_weights, lse, logits, rstd)
        ctx.grad_into = grad_into if blocks.dtype == torch.float32 else None
        ctx.set_materialize_grads(False)
        return out1, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out1, grad_lse):
        blocks, queries, norm_weights, lse, logits, rstd = ctx.saved_tensors
        if grad_out1 is None and grad_lse is None:
            return None, None, None, None, None
        n, dim, s = blocks.shape[0], blocks.shape[-1], queries.shape[0]
        b, q, g = _f32(blocks), _f32(queries), _f32(norm_weights)
        tokens = b.numel() // (n * dim)
        go = None if grad_out1 is None else _f32(grad_out1)
        gl = None if grad_lse is None else _f32(grad_lse)
        need_b, need_q, need_g = ctx.needs_input_grad[:3]
        into = ctx.grad_into() if need_b and ctx.grad_into is not None else None
        gb = into if into is not None else torch.empty_like(b) if need_b else None
        gq, gg = _param_grads(queries, norm_weights, need_q, need_g)
        _call(
            "phase1_bwd", _ptr(b), _ptr(q), _ptr(g), _ptr(lse), _ptr(logits), _ptr(rstd),
            _ptr(go), _ptr(gl), n, tokens, dim, s, _ptr(gb), int(into is not None), _ptr(gq),
            _ptr(gg), torch.get_num_threads(),
        )  # fmt: skip
        grad_b = None if gb is None or into is not None else _cast(gb, blocks.dtype)
        grad_q = None if gq is None else _cast(gq, queries.dtype)
        grad_g = None if gg is None else _cast(gg, norm_weights.dtype)
        return grad_b, grad_q, grad_g, None, None


class _Merge1(torch.autograd.Function):
    """Phase 2 with one extra source: ``lerp(out1, e, sigmoid(le - lse))``; saves ``[3, T]``
    floats (the weight, the logit and the key statistic of ``e``) beyond its inputs. Kept
    beside the general ``_Merge``, which gives the same result: on Block's hot path it takes
    0.62 of the general kernel's time (one exponential per token instead of four, and a log)."""

    @staticmethod
    def forward(ctx, out1, lse, extra, query, norm_weight, eps, grad_into):
        dim = extra.shape[-1]
        e, o1, l1 = _f32(extra), _f32(out1), _f32(lse)
        q, g = _f32(query), _f32(norm_weight)
        tokens = e.numel() // dim
        out, stats = e.new_empty(extra.shape[1:]), e.new_empty(3, tokens)
        _call(
            "merge1_fwd", _ptr(o1), _ptr(l1), _ptr(e), _ptr(q), _ptr(g), tokens, dim, eps,
            _ptr(out), _ptr(stats), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(out1, extra, query, norm_weight, stats)
        ctx.grad_into = grad_into if extra.dtype == torch.float32 else None
        ctx.lse_dtype = lse.dtype
        ctx.set_materialize_grads(False)
        return _cast(out, extra.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        out1, extra, query, norm_weight, stats = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None, None
        dim = extra.shape[-1]
        e, o1, go = _f32(extra), _f32(out1), _f32(grad_out)
        q, g = _f32(query), _f32(norm_weight)
        tokens = e.numel() // dim
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(out1.shape[:-1])
        ge, into = _extra_grad(ctx, e, need[2])
        gq, gg = _param_grads(query, norm_weight, need[3], need[4])
        _call(
            "merge1_bwd", _ptr(o1), _ptr(e), _ptr(q), _ptr(g), _ptr(stats), _ptr(go), tokens,
            dim, _ptr(go1), _ptr(glse), _ptr(ge), int(into), _ptr(gq), _ptr(gg),
            torch.get_num_threads(),
        )  # fmt: skip
        grads = (go1, glse if need[1] else None, None if into else ge, gq, gg)
        return _merge_grads(grads, (out1, ctx.lse_dtype, extra, query, norm_weight))


class _Merge(torch.autograd.Function):
    """Phase 2 with ``m >= 2`` extra sources (Full AttnRes: the group's earlier outputs);
    saves the extras' logits and key statistics and the total log-sum-exp (``[2 m + 1, T]``)."""

    @staticmethod
    def forward(ctx, out1, lse, extra, query, norm_weight, eps, grad_into):
        m, dim = extra.shape[0], extra.shape[-1]
        e, o1, l1 = _f32(extra), _f32(out1), _f32(lse)
        q, g = _f32(query), _f32(norm_weight)
        tokens = o1.numel() // dim
        out, stats = o1.new_empty(extra.shape[1:]), e.new_empty(2 * m + 1, tokens)
        _call(
            "merge_fwd", _ptr(o1), _ptr(l1), _ptr(e), _ptr(q), _ptr(g), m, tokens, dim, eps,
            _ptr(out), _ptr(stats), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(out1, lse, extra, query, norm_weight, stats)
        ctx.grad_into = grad_into if extra.dtype == torch.float32 else None
        ctx.set_materialize_grads(False)
        return _cast(out, extra.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        out1, lse, extra, query, norm_weight, stats = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None, None
        m, dim = extra.shape[0], extra.shape[-1]
        e, o1, l1, go = _f32(extra), _f32(out1), _f32(lse), _f32(grad_out)
        q, g = _f32(query), _f32(norm_weight)
        tokens = o1.numel() // dim
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(lse.shape)
        ge, into = _extra_grad(ctx, e, need[2])
        gq, gg = _param_grads(query, norm_weight, need[3], need[4])
        _call(
            "merge_bwd", _ptr(o1), _ptr(l1), _ptr(e), _ptr(q), _ptr(g), _ptr(stats), _ptr(go), m,
            tokens, dim, _ptr(go1), _ptr(glse), _ptr(ge), int(into), _ptr(gq), _ptr(gg),
            torch.get_num_threads(),
        )  # fmt: skip
        grads = (go1, glse if need[1] else None, None if into else ge, gq, gg)
        return _merge_grads(grads, (out1, lse.dtype, extra, query, norm_weight))


def phase1(
    blocks: Tensor,
    queries: Tensor,
    norm_weights: Tensor,
    eps: float = 1e-6,
    grad_into: Callable[[], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`attnres_dist.ops.two_phase.phase1` through the fused kernel. ``grad_into``: where
    the backward adds the blocks' gradient instead of returning it (float32 blocks only; a
    contiguous tensor whose leading rows have the blocks' layout, see ``attnres_dist.ops``)."""
    two_phase.check_phase1(blocks, queries, norm_weights)
    if not _runs_here(blocks, queries, norm_weights):
        return two_phase.phase1(blocks, queries, norm_weights, eps)
    return _Phase1.apply(blocks, queries, norm_weights, eps, grad_into)


def phase2(
    out1: Tensor,
    lse: Tensor,
    extra: Tensor,
    query: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
    grad_into: Callable[[], Tensor] | None = None,
) -> Tensor:
    """:func:`attnres_dist.ops.two_phase.phase2` through the fused kernels (one extra source:
    the two-way softmax; several: the general merge). ``grad_into``: as for :func:`phase1`,
    for the extras' gradient."""
    two_phase.check_phase2(out1, lse, extra)
    if not _runs_here(out1, lse, extra, query, norm_weight):
        return two_phase.phase2(out1, lse, extra, query, norm_weight, eps)
    merge = _Merge1 if extra.shape[0] == 1 else _Merge
    return merge.apply(out1, lse, extra, query, norm_weight, eps, grad_into)


# one-pass depth attention from these phases (phase 1 over all but the last source)
one_pass = one_pass_adapter(two_phase.compose_phases(phase1, phase2))
