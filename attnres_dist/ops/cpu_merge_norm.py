"""Phase 2's merge and the sublayer's RMSNorm after it, as one fused CPU kernel.

Each AttnRes sublayer reads ``norm(merge(out1, lse, extra))``, and the merged row ``h`` is
needed only by the norm. ``merge_rms_norm`` forms ``h`` per token in L1 and normalises it there
(``csrc/merge_norm_cpu.c``), so ``h`` is neither written nor read back, and the backward forms
it again from the saved weights instead of saving it: two passes over ``[tokens, D]`` and one
autograd node fewer per sublayer, forward and backward. Same arithmetic as
:func:`attnres_dist.ops.cpu_two_phase.phase2` (the two-way merge for one extra source, Block's
partial; the general one for several, Full's group outputs) followed by
:func:`attnres_dist.ops.cpu_rms_norm.rms_norm`. Float32 on the CPU; other inputs take the two
ops composed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnres_dist.ops.cpu_library import call, extra_grad, f32, ptr, runs_here

__all__ = ["fuses", "merge_rms_norm"]


class _MergeRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out1, lse, extra, weights, norm_weight, eps, norm_eps, grad_into):
        m, dim = extra.shape[0], extra.shape[-1]
        o1, l1, e = f32(out1), f32(lse), f32(extra)
        kw, w = f32(weights), f32(norm_weight)
        tokens = o1.numel() // dim
        rows = 4 if m == 1 else 2 * m + 2  # the merge's statistics, then the norm's
        y, stats = e.new_empty(extra.shape[1:]), e.new_empty(rows, tokens)
        call(
            "merge_norm_fwd", ptr(o1), ptr(l1), ptr(e), ptr(kw[0]), ptr(kw[1]), ptr(w), m,
            tokens, dim, eps, norm_eps, ptr(y), ptr(stats), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(out1, lse, extra, weights, norm_weight, stats)
        ctx.grad_into = grad_into
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out1, lse, extra, weights, norm_weight, stats = ctx.saved_tensors
        if grad is None:
            return (None,) * 8
        m, dim = extra.shape[0], extra.shape[-1]
        o1, l1, e, gy = f32(out1), f32(lse), f32(extra), f32(grad)
        kw, w = f32(weights), f32(norm_weight)
        tokens = o1.numel() // dim
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(out1.shape[:-1])
        ge, into, accumulate = extra_grad(ctx, e, need[2])
        gkw = torch.empty(2, dim) if need[3] else None
        gq, gg = (None, None) if gkw is None else (gkw[0], gkw[1])
        gw = torch.empty(norm_weight.shape) if need[4] else None
        call(
            "merge_norm_bwd", ptr(o1), ptr(l1), ptr(e), ptr(kw[0]), ptr(kw[1]), ptr(w),
            ptr(stats), ptr(gy), m, tokens, dim, ptr(go1), ptr(glse), ptr(ge), int(accumulate),
            ptr(gq), ptr(gg), ptr(gw), torch.get_num_threads(),
        )  # fmt: skip
        grad_e = None if into else ge
        return go1, glse if need[1] else None, grad_e, gkw, gw, None, None, None


def fuses(*tensors: Tensor) -> bool:
    """Whether the fused kernel takes these inputs: float32, on the CPU."""
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
    (``extra`` ``[m, ..., D]``, ``weights`` ``[2, D]``, all float32 on the CPU: ``fuses``).
    ``grad_into``: as for :func:`attnres_dist.ops.cpu_two_phase.phase2`."""
    return _MergeRMSNorm.apply(out1, lse, extra, weights, norm_weight, eps, norm_eps, grad_into)
