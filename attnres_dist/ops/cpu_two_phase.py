"""Two-phase depth attention on the CPU through the project's fused C kernels (``cpu_fused``).

Same math and signatures as :mod:`attnres_dist.ops.two_phase`; phase 1 and phase 2 run as one
C loop over tokens (``csrc/phase1_*_cpu.c``, ``csrc/merge_cpu.c``, built and loaded by
:mod:`attnres_dist.ops.cpu_library`), forward and backward, where the torch ops read every
block about ten times and dispatch ~30 small ops per pass. Sources are computed in float32
(bfloat16 / float16 ones are upcast as in the torch ops); float64 inputs and tensors off the
CPU take the torch-ops path. Phase 2 merges one extra source (the Block partial) by a two-way
softmax and several (Full AttnRes's group outputs) by the general online-softmax merge, both
fused. :func:`requirement` says why the kernels cannot run here (None when they can).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnres_dist.ops import two_phase
from attnres_dist.ops.cpu_library import (
    call,
    cast,
    f32,
    lanes,
    ptr,
    ptrs,
    requirement,
    runs_here,
)
from attnres_dist.ops.depth_attention import one_pass_adapter

__all__ = ["one_pass", "phase1", "phase1_split", "phase2", "requirement"]


def param_grads(query: Tensor, norm_weight: Tensor, need_q: bool, need_g: bool):
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
        out.append(None if grad is None else cast(grad, dtype))
    return (*out, None, None)


def extra_grad(ctx, e: Tensor, needed: bool) -> tuple[Tensor | None, bool, bool]:
    """(where a merge backward writes the extras' gradient, whether that is ``grad_into``'s
    rows, whether the kernel adds to them rather than writing them)."""
    if not needed:
        return None, False, False
    if ctx.grad_into is not None:
        rows, accumulate = ctx.grad_into()
        return rows, True, accumulate
    return torch.empty_like(e), False, False


def _in_param_dtypes(grads: list[Tensor] | None, params) -> tuple:
    """Each parameter's gradient in its dtype (None for every one when not needed)."""
    if grads is None:
        return (None,) * len(params)
    return tuple(cast(g, p.dtype) for g, p in zip(grads, params, strict=True))


class _Phase1(torch.autograd.Function):
    """Phase 1 over S queries given as separate tensors: ``apply(blocks, eps, grad_into,
    norm_eps, S, norm_weight, *queries, *norm_weights)`` returns ``(*out1, *lse)``, S ``[...,
    D]`` outputs and S ``[...]`` log-sum-exps. Each is a tensor of its own and gets its
    gradient as one, so neither direction stacks or unbinds ``[S, ...]`` tensors around the
    kernel. With ``norm_weight`` (else None) the first output is ``rms_norm(out1[0],
    norm_weight, norm_eps)``, formed in the same pass (the first sublayer of a segment merges
    nothing, so the norm is all it applies to its phase-1 output)."""

    @staticmethod
    def forward(ctx, blocks, eps, grad_into, norm_eps, s, norm_weight, *params):
        n, dim = blocks.shape[0], blocks.shape[-1]
        batch = blocks.shape[1:-1]
        b = f32(blocks)
        qg = [f32(t) for t in params]
        tokens = b.numel() // (n * dim)
        out1 = [b.new_empty(*batch, dim) for _ in range(s)]
        lse = [b.new_empty(batch) for _ in range(s)]
        width = lanes()
        tiles = -(-tokens // width)
        logits, rstd = b.new_empty(tiles, n, s, width), b.new_empty(tiles, n, width)
        w = None if norm_weight is None else f32(norm_weight)
        y = None if w is None else b.new_empty(*batch, dim)
        rn = None if w is None else b.new_empty(tokens)
        call(
            "phase1_fwd", ptr(b), ptrs(qg[:s]), ptrs(qg[s:]), n, tokens, dim, s, eps,
            ptrs(out1), ptrs(lse), ptr(logits), ptr(rstd), ptr(w), norm_eps, ptr(y), ptr(rn),
            torch.get_num_threads(),
        )  # fmt: skip
        # logits and key statistics (S / D and 1 / D of the blocks' size): the backward then
        # reads each block row once, for its products with the output gradient; with the norm,
        # its input (out1[0], as a standalone norm saves it) and reciprocal RMS
        norm = () if w is None else (norm_weight, out1[0], rn)
        ctx.save_for_backward(blocks, logits, rstd, *lse, *params, *norm)
        ctx.s, ctx.normed = s, w is not None
        ctx.grad_into = grad_into if blocks.dtype == torch.float32 else None
        ctx.set_materialize_grads(False)
        if w is not None:
            out1[0] = cast(y, blocks.dtype)
        return (*out1, *lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        s = ctx.s
        blocks, logits, rstd, *rest = ctx.saved_tensors
        lse, params = rest[:s], rest[s : 3 * s]
        norm_weight, x0, rn = rest[3 * s :] if ctx.normed else (None, None, None)
        none = (None,) * (6 + 2 * s)
        if all(g is None for g in grads):
            return none
        n, dim = blocks.shape[0], blocks.shape[-1]
        b = f32(blocks)
        qg = [f32(t) for t in params]
        tokens = b.numel() // (n * dim)
        go = [None if g is None else f32(g) for g in grads[:s]]
        gl = [None if g is None else f32(g) for g in grads[s:]]
        need = ctx.needs_input_grad
        need_b, need_q, need_g = need[0], any(need[6 : 6 + s]), any(need[6 + s :])
        into, accumulate = ctx.grad_into() if need_b and ctx.grad_into is not None else (None, 0)
        gb = into if into is not None else torch.empty_like(b) if need_b else None
        gq = [torch.empty(dim) for _ in range(s)] if need_q else None
        gg = [torch.empty(dim) for _ in range(s)] if need_g else None
        w = None if norm_weight is None else f32(norm_weight)
        gw = torch.empty(dim) if w is not None and need[5] else None
        call(
            "phase1_bwd", ptr(b), ptrs(qg[:s]), ptrs(qg[s:]), ptrs(lse), ptr(logits),
            ptr(rstd), ptrs(go), ptrs(gl), n, tokens, dim, s, ptr(gb), int(accumulate),
            ptrs(gq), ptrs(gg), ptr(w), ptr(rn), ptr(x0), ptr(gw), torch.get_num_threads(),
        )  # fmt: skip
        grad_b = None if gb is None or into is not None else cast(gb, blocks.dtype)
        grad_q = _in_param_dtypes(gq, params[:s])
        grad_g = _in_param_dtypes(gg, params[s:])
        grad_w = None if gw is None else cast(gw, norm_weight.dtype)
        return (grad_b, None, None, None, None, grad_w, *grad_q, *grad_g)


class _Merge1(torch.autograd.Function):
    """Phase 2 with one extra source: ``lerp(out1, e, sigmoid(le - lse))``; saves ``[3, T]``
    floats (the weight, the logit and the key statistic of ``e``) beyond its inputs. Kept
    beside the general ``_Merge``, which gives the same result: on Block's hot path it takes
    0.62 of the general kernel's time (one exponential per token instead of four, and a log)."""

    @staticmethod
    def forward(ctx, out1, lse, extra, query, norm_weight, eps, grad_into):
        dim = extra.shape[-1]
        e, o1, l1 = f32(extra), f32(out1), f32(lse)
        q, g = f32(query), f32(norm_weight)
        tokens = e.numel() // dim
        out, stats = e.new_empty(extra.shape[1:]), e.new_empty(3, tokens)
        call(
            "merge1_fwd", ptr(o1), ptr(l1), ptr(e), ptr(q), ptr(g), tokens, dim, eps,
            ptr(out), ptr(stats), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(out1, extra, query, norm_weight, stats)
        ctx.grad_into = grad_into if extra.dtype == torch.float32 else None
        ctx.lse_dtype = lse.dtype
        ctx.set_materialize_grads(False)
        return cast(out, extra.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        out1, extra, query, norm_weight, stats = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None, None
        dim = extra.shape[-1]
        e, o1, go = f32(extra), f32(out1), f32(grad_out)
        q, g = f32(query), f32(norm_weight)
        tokens = e.numel() // dim
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(out1.shape[:-1])
        ge, into, accumulate = extra_grad(ctx, e, need[2])
        gq, gg = param_grads(query, norm_weight, need[3], need[4])
        call(
            "merge1_bwd", ptr(o1), ptr(e), ptr(q), ptr(g), ptr(stats), ptr(go), tokens,
            dim, ptr(go1), ptr(glse), ptr(ge), int(accumulate), ptr(gq), ptr(gg),
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
        e, o1, l1 = f32(extra), f32(out1), f32(lse)
        q, g = f32(query), f32(norm_weight)
        tokens = o1.numel() // dim
        out, stats = o1.new_empty(extra.shape[1:]), e.new_empty(2 * m + 1, tokens)
        call(
            "merge_fwd", ptr(o1), ptr(l1), ptr(e), ptr(q), ptr(g), m, tokens, dim, eps,
            ptr(out), ptr(stats), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(out1, lse, extra, query, norm_weight, stats)
        ctx.grad_into = grad_into if extra.dtype == torch.float32 else None
        ctx.set_materialize_grads(False)
        return cast(out, extra.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        out1, lse, extra, query, norm_weight, stats = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None, None
        m, dim = extra.shape[0], extra.shape[-1]
        e, o1, l1, go = f32(extra), f32(out1), f32(lse), f32(grad_out)
        q, g = f32(query), f32(norm_weight)
        tokens = o1.numel() // dim
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(lse.shape)
        ge, into, accumulate = extra_grad(ctx, e, need[2])
        gq, gg = param_grads(query, norm_weight, need[3], need[4])
        call(
            "merge_bwd", ptr(o1), ptr(l1), ptr(e), ptr(q), ptr(g), ptr(stats), ptr(go), m,
            tokens, dim, ptr(go1), ptr(glse), ptr(ge), int(accumulate), ptr(gq), ptr(gg),
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
    if not runs_here(blocks, queries, norm_weights):
        return two_phase.phase1(blocks, queries, norm_weights, eps)
    out1, lse = phase1_split(blocks, queries.unbind(0), norm_weights.unbind(0), eps, grad_into)
    if len(out1) == 1:  # the final aggregation's: views, no copy
        return out1[0].unsqueeze(0), lse[0].unsqueeze(0)
    return torch.stack(out1), torch.stack(lse)


def phase1_split(
    blocks: Tensor,
    queries: Sequence[Tensor],
    norm_weights: Sequence[Tensor],
    eps: float = 1e-6,
    grad_into: Callable[[], Tensor] | None = None,
    first_norm: tuple[Tensor, float] | None = None,
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """:func:`phase1` with the S queries and gains as separate ``[D]`` tensors (the sublayers'
    parameters as they are) and S separate outputs ``(out1, lse)``: no ``[S, ...]`` stack of
    either is formed, in forward or backward. ``first_norm`` (an RMSNorm's ``(weight, eps)``,
    float32 blocks only): the first output is ``rms_norm(out1[0], weight, eps)`` instead,
    formed by the same kernel pass."""
    s = len(queries)
    if s == 0 or not runs_here(blocks, *queries, *norm_weights):
        out1, lse = two_phase.phase1(blocks, torch.stack(queries), torch.stack(norm_weights), eps)
        out1, lse = out1.unbind(0), lse.unbind(0)
        if first_norm is not None:
            weight, norm_eps = first_norm
            out1 = (F.rms_norm(out1[0], (out1[0].shape[-1],), weight, norm_eps), *out1[1:])
        return out1, lse
    if s != len(norm_weights) or any(
        t.shape != blocks.shape[-1:] for t in (*queries, *norm_weights)
    ):
        shapes = [tuple(t.shape) for t in (*queries, *norm_weights)]
        raise ValueError(f"need S >= 1 queries and S gains of shape [D], got {shapes}")
    weight, norm_eps = (None, 0.0) if first_norm is None else first_norm
    if weight is not None and (weight.shape != blocks.shape[-1:] or not runs_here(weight)):
        raise ValueError(f"first_norm: need a CPU gain of shape [D], got {tuple(weight.shape)}")
    outputs = _Phase1.apply(blocks, eps, grad_into, norm_eps, s, weight, *queries, *norm_weights)
    return outputs[:s], outputs[s:]


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
    if not runs_here(out1, lse, extra, query, norm_weight):
        return two_phase.phase2(out1, lse, extra, query, norm_weight, eps)
    merge = _Merge1 if extra.shape[0] == 1 else _Merge
    return merge.apply(out1, lse, extra, query, norm_weight, eps, grad_into)


# one-pass depth attention from these phases (phase 1 over all but the last source)
one_pass = one_pass_adapter(two_phase.compose_phases(phase1, phase2))
