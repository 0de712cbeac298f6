"""Phase 2's two-way merge and the sublayer's RMSNorm after it, as one fused CPU kernel.

Block AttnRes feeds each sublayer ``norm(merge(out1, lse, partial))``: the merged row ``h`` is
needed only by the norm. ``merge1_rms_norm`` forms ``h`` per token in L1 and normalises it
there (``merge1_norm_fwd`` in ``csrc/merge_cpu.c``), so ``h`` is neither written nor read back,
and the backward forms it again from the saved weight instead of saving it: two passes over
``[tokens, D]`` and one autograd node fewer per sublayer, forward and backward. Same values
as :func:`attnres_dist.ops.cpu_two_phase.phase2` followed by
:func:`attnres_dist.ops.cpu_rms_norm.rms_norm`; float32 only (callers compose the two ops for
other dtypes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnres_dist.ops import cpu_two_phase, two_phase
from attnres_dist.ops.cpu_library import call, f32, ptr, runs_here
from attnres_dist.ops.cpu_rms_norm import rms_norm

__all__ = ["merge1_rms_norm"]


class _Merge1RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out1, lse, extra, query, key_gain, norm_weight, eps, norm_eps, grad_into):
        dim = extra.shape[-1]
        o1, l1, e = f32(out1), f32(lse), f32(extra)
        q, g, w = f32(query), f32(key_gain), f32(norm_weight)
        tokens = e.numel() // dim
        y, stats = e.new_empty(extra.shape[1:]), e.new_empty(4, tokens)
        call(
            "merge1_norm_fwd", ptr(o1), ptr(l1), ptr(e), ptr(q), ptr(g), ptr(w), tokens, dim,
            eps, norm_eps, ptr(y), ptr(stats), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(out1, extra, query, key_gain, norm_weight, stats)
        ctx.grad_into = grad_into
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out1, extra, query, key_gain, norm_weight, stats = ctx.saved_tensors
        if grad is None:
            return (None,) * 9
        dim = extra.shape[-1]
        o1, e, gy = f32(out1), f32(extra), f32(grad)
        q, g, w = f32(query), f32(key_gain), f32(norm_weight)
        tokens = e.numel() // dim
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(out1.shape[:-1])
        into = need[2] and ctx.grad_into is not None
        ge = ctx.grad_into() if into else torch.empty_like(e) if need[2] else None
        gq, gg, gw = (torch.empty(dim) if need[k] else None for k in (3, 4, 5))
        call(
            "merge1_norm_bwd", ptr(o1), ptr(e), ptr(q), ptr(g), ptr(w), ptr(stats), ptr(gy),
            tokens, dim, ptr(go1), ptr(glse), ptr(ge), int(into), ptr(gq), ptr(gg), ptr(gw),
            torch.get_num_threads(),
        )  # fmt: skip
        grad_e = None if into else ge
        return go1, glse if need[1] else None, grad_e, gq, gg, gw, None, None, None


def merge1_rms_norm(
    out1: Tensor,
    lse: Tensor,
    extra: Tensor,
    query: Tensor,
    key_gain: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
    norm_eps: float = 1e-5,
    grad_into: Callable[[], Tensor] | None = None,
) -> Tensor:
    """``rms_norm(phase2(out1, lse, extra, query, key_gain, eps), norm_weight, norm_eps)`` for
    one extra source (``extra`` ``[1, ..., D]``). ``grad_into``: as for
    :func:`attnres_dist.ops.cpu_two_phase.phase2`."""
    two_phase.check_phase2(out1, lse, extra)
    tensors = (out1, lse, extra, query, key_gain, norm_weight)
    fused = extra.shape[0] == 1 and all(t.dtype == torch.float32 for t in tensors)
    if not (fused and runs_here(*tensors)):
        kw = {} if grad_into is None else {"grad_into": grad_into}
        merged = cpu_two_phase.phase2(out1, lse, extra, query, key_gain, eps, **kw)
        return rms_norm(merged, norm_weight, norm_eps)
    return _Merge1RMSNorm.apply(
        out1, lse, extra, query, key_gain, norm_weight, eps, norm_eps, grad_into
    )
