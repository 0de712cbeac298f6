"""Adapters from outside AttnRes kernels onto the registry's interfaces (GPU only).

- fla-core 0.6 ``fla.ops.attnres.fused_attnres(query, residuals, rms_weight, rms_eps=...)``
  computes exactly our one-pass op (RMSNorm with gain on the keys, no temperature, fp32
  statistics, one cast), so ``fla_phase2`` passes the arguments straight through. It has no
  two-phase entry points (its log-sum-exp is internal and not differentiable), so it serves
  phase 2 over the empty phase 1: every source in ``extra``, stacked as it takes them.
- flash-attn-res 0.1 ``phase_1_batched_attention_triton_op(blocks[N, B, T, D], queries[S, D],
  eps) -> (outputs, lse)`` and ``phase_2_online_softmax_merge_triton_op(partial[B, T, D],
  query, out1, lse1, eps)``: its keys' RMSNorm has no gain, so the query passed is
  ``u = g * w`` (the logit ``<w, g * k>`` equals ``<g * w, k>``) and autograd carries ``dL/du``
  to ``w`` and ``g``. Its kernels need a power-of-two ``D``, merge one partial source, and
  round their outputs to bfloat16; sources beyond the first extra one are folded in by
  :func:`merge_sources` first.

Either package imports Triton at import time; this module is imported only on first call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnres_dist.ops.depth_attention import one_pass_phase2


def merge_sources(
    out1: Tensor, lse: Tensor, extra: Tensor, u: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Fold the sources ``extra`` ``[k, *batch, D]`` into ``(out1, lse)`` (float32, autograd)."""
    e = extra.float()
    r = torch.rsqrt(e.pow(2).mean(dim=-1) + eps)
    logits = (e * u.float()).sum(dim=-1) * r  # [k, *batch]
    z = torch.cat([lse.float()[None], logits]).logsumexp(dim=0)
    out = (lse.float() - z).exp()[..., None] * out1.float()
    out = out + ((logits - z).exp()[..., None] * e).sum(dim=0)
    return out, z


def _fla_one_pass(query: Tensor, sources: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """One-pass depth attention on fla-core's ``fused_attnres`` over ``sources`` ``[n, *batch,
    D]``."""
    from fla.ops.attnres import fused_attnres

    # fused_attnres asserts 16-byte aligned sources
    aligned = sources if sources.data_ptr() % 16 == 0 else sources.clone()
    return fused_attnres(query, aligned.contiguous(), norm_weight, rms_eps=eps)


fla_phase2 = one_pass_phase2(_fla_one_pass, stacked=True)


def _flash_attn_res():
    import flash_attn_res

    return flash_attn_res


def _check_pow2(dim: int) -> None:
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"flash-attn-res needs a power-of-two hidden size, got D = {dim}")


def flash_attn_res_phase1(
    blocks: Tensor, queries: Tensor, norm_weights: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Phase 1 on flash-attn-res: ``out1`` float32 (rounded to bfloat16 inside), ``lse``."""
    n, dim, batch = blocks.shape[0], blocks.shape[-1], blocks.shape[1:-1]
    _check_pow2(dim)
    u = norm_weights.float() * queries.float()
    out1, lse = _flash_attn_res().phase_1_batched_attention_triton_op(
        blocks.reshape(n, 1, -1, dim).contiguous(), u.contiguous(), eps
    )
    num_q = u.shape[0]
    return out1.float().view(num_q, *batch, dim), lse.view(num_q, *batch)


def flash_attn_res_phase2(
    out1: Tensor,
    lse: Tensor,
    extra: Tensor,
    query: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """Phase 2 on flash-attn-res (its kernel merges one source; others are folded first)."""
    dim, batch = extra.shape[-1], extra.shape[1:-1]
    _check_pow2(dim)
    u = norm_weight.float() * query.float()
    if extra.shape[0] > 1:
        out1, lse = merge_sources(out1, lse, extra[:-1], u, eps)
    merged = _flash_attn_res().phase_2_online_softmax_merge_triton_op(
        extra[-1].reshape(1, -1, dim).contiguous(),
        u.contiguous(),
        out1.float().reshape(1, -1, dim).contiguous(),
        lse.float().reshape(1, -1).contiguous(),
        eps,
    )
    return merged.view(*batch, dim).to(extra.dtype)
