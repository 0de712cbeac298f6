"""Depth attention: public entry point, input validation and the lean autograd function.

This module owns ``depth_attention`` (the default implementation), the input
validation shared by every implementation, ``one_pass_phase2`` (the registry's phase-2
signature around a one-pass kernel), and ``_LeanDepthAttention``, a
``torch.autograd.Function`` with a hand-derived backward.

Math, per token, with ``n`` sources ``s_j`` of width ``D``, pseudo-query ``w`` and
key gain ``g``::

    r_j     = rsqrt(mean(s_j ** 2) + eps)
    logit_j = <w, r_j * s_j * g> = r_j * <s_j, u>,   u = g * w   (no 1/sqrt(D))
    alpha   = softmax_j(logit_j)
    out     = sum_j alpha_j * s_j                      (values are the raw sources)

Everything is computed in float32 (float64 stays float64) and cast back to the
sources' dtype once. For backward the function saves only the source tensors
themselves, ``query``, ``norm_weight`` and three per-token statistics
(logits, r, alpha: ``[n, T]`` each); normalised keys, stacked sources and
upcast copies are never kept. With ``G = dL/dout``::

    dalpha_j = <G, s_j> (+ dL/dweights_j)
    dlogit_j = alpha_j * (dalpha_j - sum_k alpha_k * dalpha_k)
    ds_j     = alpha_j * G + dlogit_j * r_j * (u - logit_j * r_j * s_j / D)
    du       = sum_tokens sum_j dlogit_j * r_j * s_j,   dw = du * g,   dg = du * w

Tokens are processed in chunks so that the working set of one chunk across all
sources stays cache-sized on CPU and any upcast workspace stays bounded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Bytes of float32 working set (one chunk of every source) per token chunk. On CPU
# this keeps a chunk resident in the last-level cache between the passes over it;
# elsewhere the chunks only bound the upcast workspace, so they can be large.
_CPU_CHUNK_BYTES = 16 << 20
_DEVICE_CHUNK_BYTES = 1 << 30


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for sources of ``dtype``: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def validate_inputs(query: Tensor, sources: Sequence[Tensor], norm_weight: Tensor) -> None:
    """Raise ``ValueError`` unless the arguments form a valid depth-attention call."""
    if isinstance(sources, Tensor) or not isinstance(sources, Sequence):
        raise ValueError(
            f"sources must be a list or tuple of tensors, got {type(sources).__name__}"
        )
    if len(sources) == 0:
        raise ValueError("sources must contain at least one tensor, got an empty sequence")
    for i, s in enumerate(sources):
        if not isinstance(s, Tensor):
            raise ValueError(f"sources[{i}] must be a torch.Tensor, got {type(s).__name__}")
    first = sources[0]
    if first.dim() == 0 or first.shape[-1] == 0:
        raise ValueError(f"sources must have shape [..., D] with D > 0, got {tuple(first.shape)}")
    if not first.is_floating_point():
        raise ValueError(f"sources must be floating point, got {first.dtype}")
    for i, s in enumerate(sources[1:], start=1):
        if s.shape != first.shape:
            raise ValueError(
                f"all sources must have the same shape: sources[0] is {tuple(first.shape)}, "
                f"sources[{i}] is {tuple(s.shape)}"
            )
        if s.dtype != first.dtype:
            raise ValueError(
                f"all sources must have the same dtype: sources[0] is {first.dtype}, "
                f"sources[{i}] is {s.dtype}"
            )
        if s.device != first.device:
            raise ValueError(
                f"all sources must be on the same device: sources[0] is on {first.device}, "
                f"sources[{i}] is on {s.device}"
            )
    dim = first.shape[-1]
    for name, t in (("query", query), ("norm_weight", norm_weight)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != (dim,):
            raise ValueError(
                f"{name} must have shape [D] = [{dim}] (the sources' last dim), "
                f"got {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but the sources are on {first.device}")


def _chunks(n: int, tokens: int, dim: int, device: torch.device) -> Iterator[slice]:
    budget = _CPU_CHUNK_BYTES if device.type == "cpu" else _DEVICE_CHUNK_BYTES
    rows = max(1, budget // (4 * n * dim))
    for start in range(0, tokens, rows):
        yield slice(start, min(start + rows, tokens))


def _upcast_chunk(flat: Sequence[Tensor], rows: slice, dtype: torch.dtype) -> list[Tensor]:
    # No-op views when the sources already have the compute dtype.
    return [s[rows].to(dtype) for s in flat]


class _LeanDepthAttention(torch.autograd.Function):
    """Depth attention that saves only its inputs plus ``[3, n, T]`` statistics."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, return_weights, *sources):
        shape, n = sources[0].shape, len(sources)
        dim, out_dtype, device = shape[-1], sources[0].dtype, sources[0].device
        dtype = compute_dtype(out_dtype)
        flat = [s.reshape(-1, dim) for s in sources]
        tokens = flat[0].shape[0]
        u = norm_weight.to(dtype) * query.to(dtype)

        stats = torch.empty(3, n, tokens, dtype=dtype, device=device)
        logits, rstd, alpha = stats.unbind(0)
        out = torch.empty(tokens, dim, dtype=out_dtype, device=device)
        work = None
        for rows in _chunks(n, tokens, dim, device):
            chunk = _upcast_chunk(flat, rows, dtype)
            if work is None:
                work = torch.empty_like(chunk[0])
            prod = work[: chunk[0].shape[0]]
            lg, rs, al = logits[:, rows], rstd[:, rows], alpha[:, rows]
            for j, s in enumerate(chunk):
                # Elementwise + row reduction into a reused cache-resident buffer:
                # on CPU this beats BLAS gemv for these skinny shapes.
                torch.sum(torch.mul(s, u, out=prod), dim=-1, out=lg[j])
                # ||s||^2 / D == mean(s^2): one fused reduction pass, no s*s temporary.
                torch.linalg.vector_norm(s, dim=-1, out=rs[j])
            rs.square_().mul_(1.0 / dim).add_(eps).rsqrt_()
            lg.mul_(rs)
            al.copy_(torch.softmax(lg, dim=0))
            dst = out[rows]
            acc = dst if out_dtype == dtype else prod
            torch.mul(chunk[0], al[0].unsqueeze(1), out=acc)
            for j in range(1, n):
                acc.addcmul_(chunk[j], al[j].unsqueeze(1))
            if acc is not dst:
                dst.copy_(acc)

        ctx.set_materialize_grads(False)
        ctx.save_for_backward(query, norm_weight, stats, *sources)
        ctx.shape = shape
        out = out.view(shape)
        if return_weights:
            # A copy, so that in-place edits of the returned weights cannot
            # corrupt the statistics saved for backward.
            return out, alpha.clone().view(n, *shape[:-1])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_weights=None):
        query, norm_weight, stats, *sources = ctx.saved_tensors
        need_q, need_g = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_s = ctx.needs_input_grad[4:]
        shape, n = ctx.shape, len(sources)
        dim, device = shape[-1], sources[0].device
        dtype = compute_dtype(sources[0].dtype)
        flat = [s.reshape(-1, dim) for s in sources]
        tokens = flat[0].shape[0]
        u = norm_weight.to(dtype) * query.to(dtype)
        grad_flat = None if grad_out is None else grad_out.reshape(tokens, dim)
        gw_flat = None if grad_weights is None else grad_weights.reshape(n, tokens)

        du = torch.zeros(dim, dtype=dtype, device=device) if (need_q or need_g) else None
        grads = [
            torch.empty(tokens, dim, dtype=s.dtype, device=device) if need else None
            for s, need in zip(sources, need_s, strict=True)
        ]
        need_lowp = any(gr is not None and gr.dtype != dtype for gr in grads)
        logits, rstd, alpha = stats.unbind(0)
        work = staging = None
        for rows in _chunks(n, tokens, dim, device):
            chunk = _upcast_chunk(flat, rows, dtype)
            if work is None:
                work = torch.empty_like(chunk[0])
                # Compute-dtype accumulator for gradients of lower-precision sources.
                staging = torch.empty_like(chunk[0]) if need_lowp else None
            buf = work[: chunk[0].shape[0]]
            lg, rs, al = logits[:, rows], rstd[:, rows], alpha[:, rows]
            g_c = None if grad_flat is None else grad_flat[rows].to(dtype)
            d_alpha = torch.zeros_like(lg)
            if g_c is not None:
                for j, s in enumerate(chunk):
                    torch.sum(torch.mul(g_c, s, out=buf), dim=-1, out=d_alpha[j])
            if gw_flat is not None:
                d_alpha += gw_flat[:, rows]
            d_logit = al * (d_alpha - (al * d_alpha).sum(dim=0, keepdim=True))
            coef_u = (d_logit * rs).unsqueeze(2)  # ds_j = alpha_j G + coef_u_j u + coef_s_j s_j
            coef_s = coef_u * (lg * rs * (-1.0 / dim)).unsqueeze(2)
            if du is not None:
                buf.zero_()  # now accumulates sum_j coef_u_j * s_j, reduced over rows below
            for j, s in enumerate(chunk):
                if grads[j] is not None:
                    dst = grads[j][rows]
                    acc = dst if dst.dtype == dtype else staging[: s.shape[0]]
                    if g_c is None:
                        torch.mul(s, coef_s[j], out=acc)
                    else:
                        torch.mul(g_c, al[j].unsqueeze(1), out=acc)
                        acc.addcmul_(s, coef_s[j])
                    acc.addcmul_(coef_u[j], u)
                    if acc is not dst:
                        dst.copy_(acc)
                if du is not None:
                    buf.addcmul_(s, coef_u[j])
            if du is not None:
                du += buf.sum(dim=0)

        grad_q = (du * norm_weight.to(dtype)).to(query.dtype) if need_q else None
        grad_g = (du * query.to(dtype)).to(norm_weight.dtype) if need_g else None
        grad_s = [None if gr is None else gr.view(shape) for gr in grads]
        return grad_q, grad_g, None, None, *grad_s


def depth_attention(
    query: Tensor,
    sources: Sequence[Tensor],
    norm_weight: Tensor,
    eps: float = 1e-6,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attend over ``sources`` along depth with a single learned pseudo-query.

    Memory-lean default implementation: backward keeps only the inputs and
    ``3 * n`` floats per token, recomputing everything else.

    Args:
        query: pseudo-query ``w`` of shape ``[D]``.
        sources: non-empty sequence of ``n`` same-shape, same-dtype tensors ``[..., D]``.
        norm_weight: RMSNorm gain ``g`` of shape ``[D]`` applied to the keys only.
        eps: RMSNorm epsilon.
        return_weights: also return the softmax weights.

    Returns:
        ``out`` with the sources' shape and dtype, or ``(out, weights)`` where
        ``weights`` is float32 (float64 for float64 sources) of shape ``[n, ...]``.
        Both are differentiable (first order only: the backward is not itself
        differentiable, so double backward raises).
    """
    validate_inputs(query, sources, norm_weight)
    return _LeanDepthAttention.apply(query, norm_weight, eps, return_weights, *sources)


def one_pass_phase2(kernel: Callable[..., Tensor], stacked: bool = False) -> Callable[..., Tensor]:
    """The registry's phase-2 signature around a one-pass kernel ``kernel(query, sources,
    norm_weight, eps)``: it serves the empty phase 1 (``out1 = lse = None``), each row of
    ``extra`` ``[m, *batch, D]`` a source. ``extra`` may also be a tuple of such pieces, read
    in order where they lie (the model's store and partial block: no copy to join them).
    ``stacked``: the kernel takes the sources as one tensor, else as a list of rows."""

    @functools.wraps(kernel)
    def phase2(out1, lse, extra, weights: Tensor, eps: float = 1e-6) -> Tensor:
        if out1 is not None or lse is not None:
            raise ValueError(
                f"{kernel.__name__} is a one-pass kernel: it merges into no phase-1 result "
                "(pass out1 = lse = None and every source in extra)"
            )
        pieces = (extra,) if isinstance(extra, Tensor) else tuple(extra)
        for piece in pieces:
            if not isinstance(piece, Tensor) or piece.dim() < 2 or piece.shape[0] < 1:
                got = tuple(piece.shape) if isinstance(piece, Tensor) else type(piece).__name__
                raise ValueError(f"extra must have shape [m >= 1, *batch, D], got {got}")
        dim = pieces[0].shape[-1]
        if not isinstance(weights, Tensor) or weights.shape != (2, dim):
            got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
            raise ValueError(f"weights must have shape [2, D={dim}], got {got}")
        query, gain = weights.unbind(0)
        if stacked:
            sources = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        else:
            sources = [row for piece in pieces for row in piece.unbind(0)]
        return kernel(query, sources, gain, eps)

    return phase2
