"""Plain-autograd reference implementation of depth attention.

This module owns ``depth_attention_reference``: the obviously-correct, unoptimised
formulation (stack the sources, RMS-normalise them into keys, dot with the
pseudo-query, softmax over depth, weighted sum of the raw sources). It is the
ground truth the lean autograd function is tested against; it materialises every
intermediate and lets PyTorch autograd save whatever it needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnres_dist.ops.depth_attention import compute_dtype, validate_inputs


def depth_attention_reference(
    query: Tensor,
    sources: Sequence[Tensor],
    norm_weight: Tensor,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attend over ``sources`` along depth with a single learned pseudo-query.

    Args:
        query: pseudo-query ``w`` of shape ``[D]``.
        sources: non-empty sequence of ``n`` same-shape, same-dtype tensors ``[..., D]``.
        norm_weight: RMSNorm gain ``g`` of shape ``[D]`` applied to the keys only.
        eps: RMSNorm epsilon.
        return_weights: also return the softmax weights.

    Returns:
        ``out`` with the sources' shape and dtype, or ``(out, weights)`` where
        ``weights`` is float32 (float64 for float64 sources) of shape ``[n, ...]``.
        Both are differentiable.
    """
    validate_inputs(query, sources, norm_weight)
    out_dtype = sources[0].dtype
    dtype = compute_dtype(out_dtype)
    values = torch.stack([s.to(dtype) for s in sources])  # [n, ..., D]
    rms = torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)
    keys = values * rms * norm_weight.to(dtype)
    logits = (keys * query.to(dtype)).sum(dim=-1)  # [n, ...]
    weights = torch.softmax(logits, dim=0)
    out = (weights.unsqueeze(-1) * values).sum(dim=0).to(out_dtype)
    if return_weights:
        return out, weights
    return out
