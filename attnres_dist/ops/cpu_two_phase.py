"""Two-phase depth attention on the CPU through the project's fused C kernels (``cpu_fused``).

Same math and signatures as :mod:`attnres_dist.ops.two_phase`; phase 1 and phase 2 run as one
C loop over tokens (``csrc/phase1_*_cpu.c``, ``csrc/merge_cpu.c``, built and loaded by
:mod:`attnres_dist.ops.cpu_library`), forward and backward, where the torch ops read every
block about ten times and dispatch ~30 small ops per pass. Sources are computed in float32
(bfloat16 / float16 ones are upcast as in the torch ops); float64 inputs and tensors off the
CPU take the torch-ops path. Phase 2 merges one extra source (the Block partial) by a two-way
softmax and several (Full AttnRes's group outputs) by the general online-softmax merge, both
fused, and can apply the sublayer's RMSNorm in the same pass (``csrc/merge_norm_cpu.c``): the
merged row is needed only by the norm, so it is neither written nor read back (two passes
over ``[tokens, D]`` and one autograd node fewer per sublayer, forward and backward).
:func:`requirement` says why the kernels cannot run here (None when they can).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnres_dist.ops import two_phase
from attnres_dist.ops.cpu_library import (
    call,
    cast,
    extra_grad,
    f32,
    lanes,
    ptr,
    ptrs,
    requirement,
    runs_here,
)
from attnres_dist.ops.cpu_rms_norm import rms_norm

__all__ = ["merge_rms_norm", "phase1", "phase2", "requirement"]


def weight_rows(weights: Tensor) -> tuple[Tensor, ...]:
    """Packed ``[S, 2, D]`` weights as float32 and the kernels' pointer arrays: (queries,
    gains) rows of one contiguous tensor."""
    w = f32(weights)
    return w, ptrs(w[:, 0].unbind(0)), ptrs(w[:, 1].unbind(0))


class _Phase1(torch.autograd.Function):
    """Phase 1 over packed ``[S, 2, D]`` weights: ``apply(blocks, weights, eps, grad_into,
    norm_weight, norm_eps)`` returns ``(*out1, *lse)``, S ``[..., D]`` outputs and S ``[...]``
    log-sum-exps, each a tensor of its own that gets its gradient as one, so neither direction
    stacks or unbinds ``[S, ...]`` tensors around the kernel; the weights get one gradient.
    With ``norm_weight`` (else None) the first output is ``rms_norm(out1[0], norm_weight,
    norm_eps)``, formed in the same pass (the first sublayer of a segment merges nothing, so
    the norm is all it applies to its phase-1 output)."""

    @staticmethod
    def forward(ctx, blocks, weights, eps, grad_into, norm_weight, norm_eps):
        n, dim, s = blocks.shape[0], blocks.shape[-1], weights.shape[0]
        batch = blocks.shape[1:-1]
        b = f32(blocks)
        w_rows, queries, gains = weight_rows(weights)  # alive while the kernel reads it
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
            "phase1_fwd", ptr(b), queries, gains, n, tokens, dim, s, eps,
            ptrs(out1), ptrs(lse), ptr(logits), ptr(rstd), ptr(w), norm_eps, ptr(y), ptr(rn),
            torch.get_num_threads(),
        )  # fmt: skip
        # logits and key statistics (S / D and 1 / D of the blocks' size): the backward then
        # reads each block row once, for its products with the output gradient; with the norm,
        # its input (out1[0], as a standalone norm saves it) and reciprocal RMS
        norm = () if w is None else (norm_weight, out1[0], rn)
        ctx.save_for_backward(blocks, weights, logits, rstd, *lse, *norm)
        ctx.normed = w is not None
        ctx.grad_into = grad_into if blocks.dtype == torch.float32 else None
        ctx.set_materialize_grads(False)
        if w is not None:
            out1[0] = cast(y, blocks.dtype)
        return (*out1, *lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        blocks, weights, logits, rstd, *rest = ctx.saved_tensors
        s = weights.shape[0]
        lse = rest[:s]
        norm_weight, x0, rn = rest[s:] if ctx.normed else (None, None, None)
        if all(g is None for g in grads):
            return (None,) * 6
        n, dim = blocks.shape[0], blocks.shape[-1]
        b = f32(blocks)
        w_rows, queries, gains = weight_rows(weights)  # alive while the kernel reads it
        tokens = b.numel() // (n * dim)
        go = [None if g is None else f32(g) for g in grads[:s]]
        gl = [None if g is None else f32(g) for g in grads[s:]]
        need_b, need_w, _, _, need_n, _ = ctx.needs_input_grad
        into, accumulate = ctx.grad_into() if need_b and ctx.grad_into is not None else (None, 0)
        gb = into if into is not None else torch.empty_like(b) if need_b else None
        gw = torch.empty(s, 2, dim) if need_w else None
        gq, gg = (None, None) if gw is None else (gw[:, 0].unbind(0), gw[:, 1].unbind(0))
        w = None if norm_weight is None else f32(norm_weight)
        gn = torch.empty(dim) if w is not None and need_n else None
        call(
            "phase1_bwd", ptr(b), queries, gains, ptrs(lse), ptr(logits),
            ptr(rstd), ptrs(go), ptrs(gl), n, tokens, dim, s, ptr(gb), int(accumulate),
            ptrs(gq), ptrs(gg), ptr(w), ptr(rn), ptr(x0), ptr(gn), torch.get_num_threads(),
        )  # fmt: skip
        grad_b = None if gb is None or into is not None else cast(gb, blocks.dtype)
        grad_w = None if gw is None else cast(gw, weights.dtype)
        grad_n = None if gn is None else cast(gn, norm_weight.dtype)
        return grad_b, grad_w, None, None, grad_n, None


class _Merge(torch.autograd.Function):
    """Phase 2: ``apply(out1, lse, extra, weights, eps, grad_into, norm_weight, norm_eps)``.
    One extra source (Block's partial) takes the two-way softmax (``merge1``: one exponential
    per token where the general ``merge`` takes four, and a log: docs/kernels.md); several
    (Full's group outputs) the general merge. With ``norm_weight`` (else None; float32 inputs)
    the sublayer's RMSNorm follows in the same pass (``merge_norm``): the merged row is formed
    per token and normalised in L1, never written nor read back, and the backward forms it
    again instead of saving it. Saves its inputs and ``[rows, T]`` per-token statistics."""

    @staticmethod
    def forward(ctx, out1, lse, extra, weights, eps, grad_into, norm_weight, norm_eps):
        m, dim = extra.shape[0], extra.shape[-1]
        o1, l1, e, w = f32(out1), f32(lse), f32(extra), f32(weights)
        tokens, threads = o1.numel() // dim, torch.get_num_threads()
        out = e.new_empty(extra.shape[1:])
        head = (ptr(o1), ptr(l1), ptr(e), ptr(w[0]), ptr(w[1]))
        nw = None if norm_weight is None else f32(norm_weight)  # alive while the kernel reads it
        if nw is not None:
            stats = e.new_empty(4 if m == 1 else 2 * m + 2, tokens)  # the merge's, the norm's
            call(
                "merge_norm_fwd", *head, ptr(nw), m, tokens, dim, eps, norm_eps,
                ptr(out), ptr(stats), threads,
            )  # fmt: skip
        elif m == 1:
            stats = e.new_empty(3, tokens)  # the extra's weight, logit and key statistic
            call("merge1_fwd", *head, tokens, dim, eps, ptr(out), ptr(stats), threads)
        else:
            stats = e.new_empty(2 * m + 1, tokens)  # the extras' logits and key statistics
            call("merge_fwd", *head, m, tokens, dim, eps, ptr(out), ptr(stats), threads)
        ctx.save_for_backward(out1, lse, extra, weights, norm_weight, stats)
        ctx.grad_into = grad_into if extra.dtype == torch.float32 else None
        ctx.set_materialize_grads(False)
        return cast(out, extra.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        out1, lse, extra, weights, norm_weight, stats = ctx.saved_tensors
        if grad_out is None:
            return (None,) * 8
        m, dim = extra.shape[0], extra.shape[-1]
        e, o1, l1, go, w = f32(extra), f32(out1), f32(lse), f32(grad_out), f32(weights)
        tokens, threads = o1.numel() // dim, torch.get_num_threads()
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(out1.shape[:-1])
        ge, into, accumulate = extra_grad(ctx, e, need[2])
        gw = torch.empty(2, dim) if need[3] else None
        gn = torch.empty(norm_weight.shape) if norm_weight is not None and need[6] else None
        keys, grads = (ptr(w[0]), ptr(w[1])), (ptr(go1), ptr(glse), ptr(ge), int(accumulate))
        nw = None if norm_weight is None else f32(norm_weight)  # alive while the kernel reads it
        if nw is not None:
            call(
                "merge_norm_bwd", ptr(o1), ptr(l1), ptr(e), *keys, ptr(nw),
                ptr(stats), ptr(go), m, tokens, dim, *grads, *_rows(gw), ptr(gn), threads,
            )  # fmt: skip
        elif m == 1:
            call(
                "merge1_bwd", ptr(o1), ptr(e), *keys, ptr(stats), ptr(go), tokens, dim, *grads,
                *_rows(gw), threads,
            )  # fmt: skip
        else:
            call(
                "merge_bwd", ptr(o1), ptr(l1), ptr(e), *keys, ptr(stats), ptr(go), m, tokens,
                dim, *grads, *_rows(gw), threads,
            )  # fmt: skip
        grads = (go1, glse if need[1] else None, None if into else ge, gw)
        grads = _in_dtypes(grads, (out1, lse.dtype, extra, weights))
        grad_n = None if gn is None else cast(gn, norm_weight.dtype)
        return (*grads, None, None, grad_n, None)


def _rows(gw: Tensor | None) -> tuple:
    """Pointers to the query and gain rows of a packed ``[2, D]`` gradient (NULL for None)."""
    return (None, None) if gw is None else (ptr(gw[0]), ptr(gw[1]))


def _in_dtypes(grads, inputs) -> tuple:
    """Each float32 gradient (or None) in its input's dtype (a dtype stands for itself)."""
    out = []
    for grad, ref in zip(grads, inputs, strict=True):
        dtype = ref if isinstance(ref, torch.dtype) else ref.dtype
        out.append(None if grad is None else cast(grad, dtype))
    return tuple(out)


def phase1(
    blocks: Tensor,
    weights: Tensor,
    eps: float = 1e-6,
    grad_into: Callable[[], tuple[Tensor, bool]] | None = None,
    first_norm: tuple[Tensor, float] | None = None,
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """:func:`attnres_dist.ops.two_phase.phase1` through the fused kernel, with its two
    options: ``grad_into`` (float32 blocks) gives where the backward adds the blocks'
    gradient instead of returning it; ``first_norm`` (an RMSNorm's ``(weight, eps)``) makes
    the first output ``rms_norm(out1[0], weight, eps)``, formed by the same pass (see
    ``attnres_dist.ops``). Inputs off the CPU or in float64 take the torch ops."""
    two_phase.check_packed(blocks, weights)
    weight, norm_eps = (None, 0.0) if first_norm is None else first_norm
    if not runs_here(blocks, weights, *(() if weight is None else (weight,))):
        out1, lse = two_phase.phase1(blocks, weights, eps)
        if weight is not None:
            out1 = (F.rms_norm(out1[0], (out1[0].shape[-1],), weight, norm_eps), *out1[1:])
        return out1, lse
    if weight is not None and weight.shape != blocks.shape[-1:]:
        raise ValueError(f"first_norm: need a gain of shape [D], got {tuple(weight.shape)}")
    s = weights.shape[0]
    outputs = _Phase1.apply(blocks, weights, eps, grad_into, weight, norm_eps)
    return outputs[:s], outputs[s:]


def fuses(*tensors: Tensor) -> bool:
    """Whether phase 2's fused norm takes these inputs: float32, on the CPU."""
    return all(t.dtype == torch.float32 for t in tensors) and runs_here(*tensors)


def merge_rms_norm(
    out1: Tensor,
    lse: Tensor,
    extra: Tensor,
    weights: Tensor,
    norm_weight: Tensor,
    norm_eps: float = 1e-5,
    eps: float = 1e-6,
    grad_into: Callable[[], tuple[Tensor, bool]] | None = None,
) -> Tensor:
    """``rms_norm(phase2(out1, lse, extra, weights, eps), norm_weight, norm_eps)`` in one pass
    (``extra`` ``[m, ..., D]``, ``weights`` ``[2, D]``, all float32 on the CPU: ``fuses``)."""
    return _Merge.apply(out1, lse, extra, weights, eps, grad_into, norm_weight, norm_eps)


def phase2(
    out1: Tensor,
    lse: Tensor,
    extra: Tensor,
    weights: Tensor,
    eps: float = 1e-6,
    grad_into: Callable[[], tuple[Tensor, bool]] | None = None,
    norm: tuple[Tensor, float] | None = None,
) -> Tensor:
    """:func:`attnres_dist.ops.two_phase.phase2` through the fused kernels, with its two
    options: ``grad_into`` as for :func:`phase1`, for the extras' gradient; ``norm`` (an
    RMSNorm's ``(weight, eps)``) applies the sublayer's RMSNorm to the result in the same pass
    (:func:`merge_rms_norm`)."""
    two_phase.check_phase2(out1, lse, extra)
    two_phase.check_packed_row(weights, extra.shape[-1])
    if norm is not None and fuses(out1, lse, extra, weights, norm[0]):
        return merge_rms_norm(out1, lse, extra, weights, *norm, eps, grad_into)
    if norm is not None:
        return rms_norm(phase2(out1, lse, extra, weights, eps, grad_into), *norm)
    if not runs_here(out1, lse, extra, weights):
        return two_phase.phase2(out1, lse, extra, weights, eps)
    return _Merge.apply(out1, lse, extra, weights, eps, grad_into, None, 0.0)
