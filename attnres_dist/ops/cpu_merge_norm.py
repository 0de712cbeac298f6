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

from attnres_dist.ops import cpu_two_phase, two_phase
from attnres_dist.ops.cpu_library import call, f32, ptr, runs_here
from attnres_dist.ops.cpu_rms_norm import rms_norm
from attnres_dist.ops.cpu_two_phase import extra_grad, param_grads

__all__ = ["merge_rms_norm"]


class _MergeRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out1, lse, extra, query, key_gain, norm_weight, eps, norm_eps, grad_into):
        m, dim = extra.shape[0], extra.shape[-1]
        o1, l1, e = f32(out1), f32(lse), f32(extra)
        q, g, w = f32(query), f32(key_gain), f32(norm_weight)
        tokens = o1.numel() // dim
        rows = 4 if m == 1 else 2 * m + 2  # the merge's statistics, then the norm's
        y, stats = e.new_empty(extra.shape[1:]), e.new_empty(rows, tokens)
        call(
            "merge_norm_fwd", ptr(o1), ptr(l1), ptr(e), ptr(q), ptr(g), ptr(w), m, tokens,
            dim, eps, norm_eps, ptr(y), ptr(stats), torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(out1, lse, extra, query, key_gain, norm_weight, stats)
        ctx.grad_into = grad_into
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out1, lse, extra, query, key_gain, norm_weight, stats = ctx.saved_tensors
        if grad is None:
            return (None,) * 9
        m, dim = extra.shape[0], extra.shape[-1]
        o1, l1, e, gy = f32(out1), f32(lse), f32(extra), f32(grad)
        q, g, w = f32(query), f32(key_gain), f32(norm_weight)
        tokens = o1.numel() // dim
        need = ctx.needs_input_grad
        go1 = torch.empty_like(o1) if need[0] else None
        glse = o1.new_empty(out1.shape[:-1])
        ge, into, accumulate = extra_grad(ctx, e, need[2])
        gq, gg = param_grads(query, key_gain, need[3], need[4])
        gw = torch.empty(norm_weight.shape) if need[5] else None
        call(
            "merge_norm_bwd", ptr(o1), ptr(l1), ptr(e), ptr(q), ptr(g), ptr(w), ptr(stats),
            ptr(gy), m, tokens, dim, ptr(go1), ptr(glse), ptr(ge), int(accumulate), ptr(gq),
            ptr(gg), ptr(gw), torch.get_num_threads(),
        )  # fmt: skip
        grad_e = None if into else ge
        return go1, glse if need[1] else None, grad_e, gq, gg, gw, None, None, None


def merge_rms_norm(
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
    """``rms_norm(phase2(out1, lse, extra, query, key_gain, eps), norm_weight, norm_eps)``
    (``extra`` ``[m, ..., D]``). ``grad_into``: as for
    :func:`attnres_dist.ops.cpu_two_phase.phase2`."""
    two_phase.check_phase2(out1, lse, extra)
    tensors = (out1, lse, extra, query, key_gain, norm_weight)
    fused = all(t.dtype == torch.float32 for t in tensors)
    if not (fused and runs_here(*tensors)):
        kw = {} if grad_into is None else {"grad_into": grad_into}
        merged = cpu_two_phase.phase2(out1, lse, extra, query, key_gain, eps, **kw)
        return rms_norm(merged, norm_weight, norm_eps)
    return _MergeRMSNorm.apply(
        out1, lse, extra, query, key_gain, norm_weight, eps, norm_eps, grad_into
    )
