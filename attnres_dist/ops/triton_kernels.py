"""Triton kernels of two-phase depth attention and the launch rules that size them.

Notation as in :mod:`attnres_dist.ops.depth_attention`: per token, ``r_j = rsqrt(mean(b_j^2) +
eps)``, ``logit_lj = r_j * <b_j, u_l>`` with ``u_l = g_l * w_l``. All arithmetic is float32.

- ``phase1_fwd``: one program per tile of ``BLOCK_T`` tokens and ``BLOCK_S`` queries. It reads
  each completed block once (one ``[BLOCK_T, D]`` tile), computes its rms statistic once, the
  logits of all the tile's queries from it, and folds it into an online softmax whose
  ``[BLOCK_S, BLOCK_T, D]`` accumulator stays in registers; it writes ``out1`` and ``lse``.
- ``phase2_fwd``: merges the ``m`` extra sources of one sublayer into ``(out1, lse)`` by the
  same online softmax (``out1`` enters with weight ``exp(lse)``) and writes the output in the
  sources' dtype plus the merged log-sum-exp (kept for backward, one float per token).
- ``phase1_bwd`` / ``phase2_bwd``: persistent programs (a grid of at most a few per SM) that
  loop over token tiles, recompute ``r`` and the logits from the sources, write the sources'
  gradients tile by tile and accumulate ``dL/du`` per program in registers; the host sums the
  ``[programs, S, D]`` partials (deterministic, no atomics).

A kernel is compiled per interpretation mode (``TRITON_INTERPRET=1`` runs it on CPU tensors
through Triton's interpreter), so one process can hold both. Only features of Triton 3.6 are
used.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

# Register budget: elements of the largest [BLOCK_S, BLOCK_T, BLOCK_D] float32 tile a program
# holds (forward accumulator, backward dL/dout1 tile); larger S * D is split into query groups.
# Compiled ahead of time for sm_90 with Triton 3.6 and 3.9 (cuobjdump -res-usage), 4096
# elements on 8 warps take 64-128 registers per thread in the forward kernels and 117-202 in
# the backward ones, the phase-1 backward over query groups spilling at most 64 bytes; 8192
# elements on 8 warps reach 255 registers with larger spills, and 16 warps (a 128-register
# cap) spill more.
TILE_BUDGET = 4096
MAX_BLOCK_T = 16
# Persistent backward grids: programs per streaming multiprocessor.
PROGRAMS_PER_SM = 4
INTERPRETER_PROGRAMS = 2


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# Reductions are written tl.reduce(x, axis, _SUM) and fills tl.full: exactly what tl.sum and
# tl.zeros do, minus their @jit wrappers. Those wrappers are compiled-mode objects when Triton
# was imported without TRITON_INTERPRET, and the interpreter cannot call them; it recognises
# this combine function and reduces with numpy.
_SUM = tl.standard._sum_combine

_JIT_CACHE: dict[tuple[str, bool], object] = {}
_RUNTIME_SIZES = ("n", "m", "T", "D", "S", "tiles")


def _kernel(fn):
    # triton.jit decides at decoration time between compiled and interpreted; decorating per
    # mode lets tests interpret while the same process may later compile for a GPU.
    key = (fn.__name__, interpreting())
    kernel = _JIT_CACHE.get(key)
    if kernel is None:
        # Sizes stay runtime values: a size of 1 would otherwise become a compile-time constant.
        params = inspect.signature(fn).parameters
        sizes = [name for name in _RUNTIME_SIZES if name in params]
        kernel = _JIT_CACHE[key] = triton.jit(fn, do_not_specialize=sizes)
    return kernel


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(1, int(x)))


def tile_sizes(num_queries: int, tokens: int, dim: int) -> tuple[int, int, int]:
    """``(BLOCK_S, BLOCK_T, BLOCK_D)`` within :data:`TILE_BUDGET` (queries beyond ``BLOCK_S``
    are handled by further launches)."""
    block_d = _pow2(dim)
    block_s = min(_pow2(num_queries), max(1, TILE_BUDGET // block_d))
    block_s = 1 << (block_s.bit_length() - 1)  # floor to a power of two
    block_t = max(1, TILE_BUDGET // (block_s * block_d))
    block_t = min(1 << (block_t.bit_length() - 1), MAX_BLOCK_T, _pow2(tokens))
    return block_s, block_t, block_d


def num_warps(elements: int) -> int:
    """Warps for a program whose largest tile has ``elements`` float32 values."""
    return 8 if elements >= 4096 else 4


def persistent_programs(tiles: int, device: torch.device) -> int:
    if interpreting() or device.type != "cuda":
        return max(1, min(tiles, INTERPRETER_PROGRAMS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, PROGRAMS_PER_SM * sms))


def _probe(x, n):
    acc = tl.full([2], 0.0, tl.float32)
    for _ in range(0, n):
        acc += tl.load(x + tl.arange(0, 2))
    tl.store(x + tl.arange(0, 2), acc)


_INTERPRETER_PROBLEM: list[str | None] = []


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None (probed once).

    Triton 3.6's interpreter, for one, fails on a loop with a runtime bound under numpy >= 2.4
    (it converts a one-element array with ``int()``).
    """
    if not _INTERPRETER_PROBLEM:
        x = torch.ones(2)
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            _kernel(_probe)[(1,)](x, 3)
            problem = None if x.tolist() == [3.0, 3.0] else f"probe gave {x.tolist()}"
        except Exception as exc:  # the reason is whatever the interpreter raised
            text = str(exc).strip().splitlines()
            problem = f"{type(exc).__name__}: {text[0] if text else ''}"
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET")
            else:
                os.environ["TRITON_INTERPRET"] = old
        _INTERPRETER_PROBLEM.append(problem)
    return _INTERPRETER_PROBLEM[0]


def _phase1_fwd(
    blocks,
    u,
    out1,
    lse,
    n,
    T,
    D,
    S,
    eps,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s, mask_t, mask_d = offs_s < S, offs_t < T, offs_d < D
    mask_td = mask_t[:, None] & mask_d[None, :]
    stride_n = T.to(tl.int64) * D
    tok = offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]  # [BT, BD] offsets in one block

    uq = tl.load(
        u + offs_s[:, None] * D + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_S, BLOCK_T], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_S, BLOCK_T], 0.0, tl.float32)
    acc = tl.full([BLOCK_S, BLOCK_T, BLOCK_D], 0.0, tl.float32)
    for j in range(0, n):
        b = tl.load(blocks + j * stride_n + tok, mask=mask_td, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.reduce(b * b, 1, _SUM) / D + eps)
        logit = tl.reduce(b[None, :, :] * uq[:, None, :], 2, _SUM) * r[None, :]
        m_new = tl.maximum(m_i, logit)
        scale = tl.exp(m_i - m_new)
        p = tl.exp(logit - m_new)
        l_i = l_i * scale + p
        acc = acc * scale[:, :, None] + p[:, :, None] * b[None, :, :]
        m_i = m_new

    out = acc / l_i[:, :, None]
    mask_st = mask_s[:, None] & mask_t[None, :]
    dst = offs_s.to(tl.int64)[:, None, None] * stride_n + tok[None, :, :]
    tl.store(out1 + dst, out, mask=mask_st[:, :, None] & mask_d[None, None, :])
    tl.store(lse + offs_s[:, None] * T + offs_t[None, :], m_i + tl.log(l_i), mask=mask_st)


def _phase1_bwd(
    blocks,
    u,
    out1,
    lse,
    g_out1,
    g_lse,
    d_blocks,
    du_part,
    n,
    T,
    D,
    S,
    eps,
    tiles,
    HAS_G_LSE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s, mask_d = offs_s < S, offs_d < D
    mask_sd = mask_s[:, None] & mask_d[None, :]
    stride_n = T.to(tl.int64) * D
    uq = tl.load(u + offs_s[:, None] * D + offs_d[None, :], mask=mask_sd, other=0.0)
    du_acc = tl.full([BLOCK_S, BLOCK_D], 0.0, tl.float32)

    for tile in range(pid, tiles, programs):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        mask_td = mask_t[:, None] & mask_d[None, :]
        mask_st = mask_s[:, None] & mask_t[None, :]
        mask_std = mask_st[:, :, None] & mask_d[None, None, :]
        tok = offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]
        idx = offs_s.to(tl.int64)[:, None, None] * stride_n + tok[None, :, :]
        idx_st = offs_s[:, None] * T + offs_t[None, :]

        grad = tl.load(g_out1 + idx, mask=mask_std, other=0.0).to(tl.float32)
        o1 = tl.load(out1 + idx, mask=mask_std, other=0.0)
        # dlogit_lj = alpha_lj * (<G_l, b_j> - <G_l, out1_l> + dL/dlse_l)
        delta = tl.reduce(grad * o1, 2, _SUM)
        if HAS_G_LSE:
            delta -= tl.load(g_lse + idx_st, mask=mask_st, other=0.0).to(tl.float32)
        z = tl.load(lse + idx_st, mask=mask_st, other=0.0)

        for j in range(0, n):
            src = j * stride_n + tok
            b = tl.load(blocks + src, mask=mask_td, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.reduce(b * b, 1, _SUM) / D + eps)
            logit = tl.reduce(b[None, :, :] * uq[:, None, :], 2, _SUM) * r[None, :]
            alpha = tl.where(mask_st, tl.exp(logit - z), 0.0)
            dl = alpha * (tl.reduce(grad * b[None, :, :], 2, _SUM) - delta)
            # db_j = sum_l [alpha_lj G_l + dl_lj r_j (u_l - logit_lj r_j b_j / D)]
            db = tl.reduce(alpha[:, :, None] * grad, 0, _SUM)
            db += r[:, None] * tl.reduce(dl[:, :, None] * uq[:, None, :], 0, _SUM)
            db -= (r * r / D * tl.reduce(dl * logit, 0, _SUM))[:, None] * b
            if ACCUMULATE:
                db += tl.load(d_blocks + src, mask=mask_td, other=0.0).to(tl.float32)
            tl.store(d_blocks + src, db.to(d_blocks.dtype.element_ty), mask=mask_td)
            du_acc += tl.reduce(dl[:, :, None] * (b * r[:, None])[None, :, :], 1, _SUM)

    part = pid.to(tl.int64) * S * D + offs_s[:, None] * D + offs_d[None, :]
    tl.store(du_part + part, du_acc, mask=mask_sd)


def _phase2_fwd(
    out1,
    lse,
    extra,
    u,
    out,
    lse_out,
    m,
    T,
    D,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t, mask_d = offs_t < T, offs_d < D
    mask_td = mask_t[:, None] & mask_d[None, :]
    stride_n = T.to(tl.int64) * D
    tok = offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]

    uq = tl.load(u + offs_d, mask=mask_d, other=0.0)
    # out1 is already normalised: it enters the online softmax as one source of weight exp(lse).
    acc = tl.load(out1 + tok, mask=mask_td, other=0.0)
    m_i = tl.load(lse + offs_t, mask=mask_t, other=0.0)
    l_i = tl.full([BLOCK_T], 1.0, tl.float32)
    for k in range(0, m):
        e = tl.load(extra + k * stride_n + tok, mask=mask_td, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.reduce(e * e, 1, _SUM) / D + eps)
        c = tl.reduce(e * uq[None, :], 1, _SUM) * r
        m_new = tl.maximum(m_i, c)
        scale = tl.exp(m_i - m_new)
        p = tl.exp(c - m_new)
        l_i = l_i * scale + p
        acc = acc * scale[:, None] + p[:, None] * e
        m_i = m_new
    res = acc / l_i[:, None]
    tl.store(out + tok, res.to(out.dtype.element_ty), mask=mask_td)
    tl.store(lse_out + offs_t, m_i + tl.log(l_i), mask=mask_t)


def _phase2_bwd(
    grad_out,
    out1,
    lse,
    lse_tot,
    extra,
    u,
    d_out1,
    d_lse,
    d_extra,
    du_part,
    m,
    T,
    D,
    eps,
    tiles,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    stride_n = T.to(tl.int64) * D
    uq = tl.load(u + offs_d, mask=mask_d, other=0.0)
    du_acc = tl.full([BLOCK_D], 0.0, tl.float32)

    for tile in range(pid, tiles, programs):
        offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        mask_td = mask_t[:, None] & mask_d[None, :]
        tok = offs_t.to(tl.int64)[:, None] * D + offs_d[None, :]
        grad = tl.load(grad_out + tok, mask=mask_td, other=0.0).to(tl.float32)
        o1 = tl.load(out1 + tok, mask=mask_td, other=0.0)
        z_tot = tl.load(lse_tot + offs_t, mask=mask_t, other=0.0)
        beta0 = tl.where(mask_t, tl.exp(tl.load(lse + offs_t, mask=mask_t, other=0.0) - z_tot), 0.0)
        g_o1 = tl.reduce(grad * o1, 1, _SUM)
        # delta = <G, out> = beta_0 <G, out1> + sum_k beta_k <G, e_k>
        delta = beta0 * g_o1
        for k in range(0, m):
            e = tl.load(extra + k * stride_n + tok, mask=mask_td, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.reduce(e * e, 1, _SUM) / D + eps)
            c = tl.reduce(e * uq[None, :], 1, _SUM) * r
            beta = tl.where(mask_t, tl.exp(c - z_tot), 0.0)
            delta += beta * tl.reduce(grad * e, 1, _SUM)
        tl.store(d_out1 + tok, beta0[:, None] * grad, mask=mask_td)
        tl.store(d_lse + offs_t, beta0 * (g_o1 - delta), mask=mask_t)
        for k in range(0, m):
            src = k * stride_n + tok
            e = tl.load(extra + src, mask=mask_td, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.reduce(e * e, 1, _SUM) / D + eps)
            c = tl.reduce(e * uq[None, :], 1, _SUM) * r
            beta = tl.where(mask_t, tl.exp(c - z_tot), 0.0)
            dc = beta * (tl.reduce(grad * e, 1, _SUM) - delta)
            de = beta[:, None] * grad + (dc * r)[:, None] * uq[None, :]
            de -= (dc * c * r * r / D)[:, None] * e
            tl.store(d_extra + src, de.to(d_extra.dtype.element_ty), mask=mask_td)
            du_acc += tl.reduce((dc * r)[:, None] * e, 0, _SUM)

    tl.store(du_part + pid.to(tl.int64) * D + offs_d, du_acc, mask=mask_d)


def phase1_fwd_kernel():
    return _kernel(_phase1_fwd)


def phase1_bwd_kernel():
    return _kernel(_phase1_bwd)


def phase2_fwd_kernel():
    return _kernel(_phase2_fwd)


def phase2_bwd_kernel():
    return _kernel(_phase2_bwd)
