"""Two-phase depth attention in torch ops (the paper's Algorithm 1), CPU and GPU.

The S pseudo-queries of a block do not depend on the input, so they can attend over the
completed blocks in one batched pass (``phase1``); each sublayer then merges the sources that
are not in the store (the partial block, or a Full group's own earlier outputs) into its
phase-1 result by online softmax (``phase2``). The merge is exact: the result is the one-pass
softmax over all sources. Math per token, blocks ``b_j``, queries ``w_l``, gains ``g_l``::

    r_j      = rsqrt(mean(b_j ** 2) + eps)           computed once per block and phase-1 pass
    logit_lj = r_j * <b_j, u_l>,  u_l = g_l * w_l     one GEMM: [n * T, D] x [D, S]
    lse_l    = logsumexp_j logit_lj
    out1_l   = sum_j exp(logit_lj - lse_l) * b_j      one batched matmul over tokens

``phase2`` with extra sources ``e_k`` (logits ``le_k`` as above)::

    LSE  = logaddexp(lse, logsumexp_k le_k)
    out  = exp(lse - LSE) * out1 + sum_k exp(le_k - LSE) * e_k

With one extra source (the Block partial) the merge is a two-way softmax: ``out = lerp(out1, e,
a)``, ``a = sigmoid(le - lse)`` (``_Merge1``), a handful of ops per sublayer.

Both take the model's queries and gains packed, each mixer's pair one ``[2, D]`` row of a
parameter (``model/depth_mixing.py``), and return their gradient as one tensor: ``d w = du * g``
and ``d g = du * w`` in one product with the pair swapped, which the parameter takes as it is
(separate gradients would be packed again by the model's graph: a stack per mixer and a cat
per block).

Both are ``torch.autograd.Function``s with hand-derived backwards that save only their inputs
and per-token statistics (phase 1: the key statistics ``[n, T]`` and the logits ``[n, T, S]``,
``S / D`` of the blocks' size; phase 2: ``[T]`` floats): no normalised keys, no upcast
copies, no ``[S, n, T, D]`` products. All arithmetic is float32 (float64 stays float64);
``phase2`` casts to the sources' dtype once, at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnres_dist.ops.depth_attention import compute_dtype


def _key_stats(flat: Tensor, eps: float) -> Tensor:
    """``rsqrt(mean(x ** 2) + eps)`` over the last dim of ``flat`` [rows, D] (compute dtype)."""
    dim = flat.shape[-1]
    # ||x||^2 / D == mean(x^2): one fused reduction, no x*x temporary.
    return torch.linalg.vector_norm(flat, dim=-1).square_().mul_(1.0 / dim).add_(eps).rsqrt_()


def _matmul(a: Tensor, b: Tensor, into: Tensor | None = None) -> Tensor:
    """``a @ b`` for ``[..., M, K] x [..., K, N]`` (``into``: added to it, in place where it
    can be). Traced by the compiler, written as a broadcast product summed over ``K``: every
    product here has a side of S or n (a few queries or blocks), so it is bound by the bytes
    it reads, and inductor fuses the sum with the elementwise work around it into its own
    kernel instead of calling a separate matmul (one launch and one host call fewer each:
    docs/compile.md). Eager, the matmul: the broadcast product would be materialised. The one
    place this backend asks whether it is traced."""
    if torch.compiler.is_compiling():
        out = (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
        return out if into is None else into + out
    return torch.matmul(a, b) if into is None else into.addmm_(a, b)


def _block_major_sum(mix: Tensor, b: Tensor, coef: Tensor) -> Tensor:
    """``mix + b * coef`` laid out as ``b`` (block-major) where ``mix`` is a token-major view:
    the product first, so the sum takes its layout (the plain ``addcmul`` would take ``mix``'s,
    and the reshape after it a copy). Eager, one product more than an ``addcmul`` into a
    tensor like ``b`` (docs/kernels.md); traced, one fused kernel either way."""
    return (b * coef).add_(mix)


def check_packed(blocks: Tensor, weights: Tensor) -> None:
    """Phase 1's inputs: blocks ``[n >= 1, *batch, D]``, weights ``[S, 2, D]`` beside them."""
    if not isinstance(blocks, Tensor) or blocks.dim() < 2 or blocks.shape[0] < 1:
        got = tuple(blocks.shape) if isinstance(blocks, Tensor) else type(blocks).__name__
        raise ValueError(f"blocks must have shape [n >= 1, *batch, D], got {got}")
    if not blocks.is_floating_point():
        raise ValueError(f"blocks must be floating point, got {blocks.dtype}")
    dim = blocks.shape[-1]
    shape = tuple(weights.shape) if isinstance(weights, Tensor) else None
    if shape is None or len(shape) != 3 or shape[0] < 1 or shape[1:] != (2, dim):
        got = shape if shape is not None else type(weights).__name__
        want = f"[S, 2, D={dim}] (query, gain per mixer)"
        raise ValueError(f"weights must have shape {want}, got {got}")
    if weights.device != blocks.device:
        raise ValueError(f"weights are on {weights.device} but blocks are on {blocks.device}")


def check_packed_row(weights: Tensor, dim: int) -> None:
    """Phase 2's weights: one mixer's ``[2, D]`` (query, gain)."""
    shape = tuple(weights.shape) if isinstance(weights, Tensor) else None
    if shape != (2, dim):
        got = shape if shape is not None else type(weights).__name__
        raise ValueError(f"weights must have shape [2, D={dim}] (query, gain), got {got}")


def check_phase2(out1: Tensor, lse: Tensor, extra: Tensor) -> None:
    if extra.dim() < 2 or extra.shape[0] < 1 or extra.shape[1:] != out1.shape:
        raise ValueError(
            f"extra must have shape [m >= 1, *batch, D] with [*batch, D] = {tuple(out1.shape)}, "
            f"got {tuple(extra.shape)}"
        )
    if lse.shape != out1.shape[:-1]:
        raise ValueError(f"lse must have shape {tuple(out1.shape[:-1])}, got {tuple(lse.shape)}")


def _products(weights: Tensor, dtype: torch.dtype) -> Tensor:
    """``u = g * w`` of packed ``[..., 2, D]`` weights (query, gain), in ``dtype``."""
    w = weights.to(dtype)
    return w[..., 0, :] * w[..., 1, :]


def _weights_grad(du: Tensor, weights: Tensor) -> Tensor:
    """The gradient of packed ``[..., 2, D]`` weights from ``du`` ``[..., D]``: ``d w = du * g``
    and ``d g = du * w`` are one product with the pair swapped (no stack, one buffer)."""
    return (du.unsqueeze(-2) * weights.flip(-2).to(du.dtype)).to(weights.dtype)


class _Phase1(torch.autograd.Function):
    """Phase 1 over packed ``[S, 2, D]`` weights (query, gain): one gradient for both."""

    @staticmethod
    def forward(ctx, blocks, weights, eps):
        n, dim = blocks.shape[0], blocks.shape[-1]
        batch = blocks.shape[1:-1]
        dtype = compute_dtype(blocks.dtype)
        b = blocks.reshape(n, -1, dim).to(dtype)  # [n, T, D]; no copy for fp32 input
        tokens, s = b.shape[1], weights.shape[0]
        u = _products(weights, dtype)  # [S, D]
        flat = b.reshape(n * tokens, dim)
        rstd = _key_stats(flat, eps)  # [n * T]
        logits = _matmul(flat, u.t()).mul_(rstd.unsqueeze(1)).view(n, tokens, s)
        p = torch.softmax(logits, dim=0)  # [n, T, S]
        # lse = max - log(max p): the largest weight is 1 / sum exp(logit - max), so this is
        # logsumexp in three small ops where torch's logsumexp takes nine
        lse = torch.amax(logits, dim=0).sub_(torch.amax(p, dim=0).log_())  # [T, S]
        # out1[t] = p[:, t, :]^T @ b[:, t, :]: one batched matmul over tokens, written
        # token-major; out1 is returned as its [S, T, D] view (no transposing copy).
        out1 = _matmul(p.permute(1, 2, 0), b.transpose(0, 1)).transpose(0, 1)  # [S, T, D]
        lse = lse.t()  # [S, T] view
        # the logits ([n, T, S], S / D of the blocks' size) are kept: the backward then needs
        # one batched product with the blocks instead of two, and no log-sum-exp
        ctx.save_for_backward(blocks, weights, rstd, logits)
        ctx.set_materialize_grads(False)
        return out1.view(s, *batch, dim), lse.view(s, *batch)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out1, grad_lse):
        blocks, weights, rstd, logits = ctx.saved_tensors
        n, dim = blocks.shape[0], blocks.shape[-1]
        dtype = compute_dtype(blocks.dtype)
        b = blocks.reshape(n, -1, dim).to(dtype)
        tokens, s = b.shape[1], weights.shape[0]
        u = _products(weights, dtype)
        p = torch.softmax(logits, dim=0)  # [n, T, S], as in the forward
        r = rstd.view(n, tokens, 1)
        # d logit_lj = p_lj (d p_lj - sum_j' p_lj' d p_lj' + d lse_l), d p_lj = <G_l, b_j>:
        # per token, [n, D] x [D, S]; token-major, then read as [n, T, S] views
        if grad_out1 is None:
            d_logit = grad_lse.reshape(s, tokens).to(dtype).t().unsqueeze(0) * p
        else:
            g_t = grad_out1.reshape(s, tokens, dim).to(dtype).transpose(0, 1)  # [T, S, D]
            d_p = _matmul(b.transpose(0, 1), g_t.transpose(1, 2)).transpose(0, 1)  # [n, T, S]
            d_logit = d_p - (p * d_p).sum(dim=0, keepdim=True)
            if grad_lse is not None:
                d_logit += grad_lse.reshape(s, tokens).to(dtype).t().unsqueeze(0)
            d_logit.mul_(p)
        d_raw = d_logit * r  # d <b_j, u_l> = r_j dlogit_lj, [n, T, S]
        need_b, need_w = ctx.needs_input_grad[:2]
        grad_b = grad_w = None
        if need_b:
            # d b_j = sum_l p_lj G_l + r_j sum_l dlogit_lj u_l - r_j^2 / D * c_j * b_j,
            # c_j = sum_l dlogit_lj * logit_lj
            coef = (d_logit * logits).sum(dim=-1, keepdim=True).mul_(r.square()).mul_(-1 / dim)
            if grad_out1 is None:
                gb = b * coef
            else:
                # the token-major product, made block-major by the add that follows it
                mix = _matmul(p.transpose(0, 1), g_t).transpose(0, 1)  # [n, T, D] view
                gb = _block_major_sum(mix, b, coef)
            flat = _matmul(d_raw.reshape(n * tokens, s), u, into=gb.view(n * tokens, dim))
            grad_b = flat.to(blocks.dtype).view(blocks.shape)
        if need_w:
            du = _matmul(d_raw.reshape(n * tokens, s).t(), b.reshape(n * tokens, dim))  # [S, D]
            grad_w = _weights_grad(du, weights)
        return grad_b, grad_w, None


class _Phase2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out1, lse, extra, weights, eps):
        m, dim = extra.shape[0], extra.shape[-1]
        shape = extra.shape[1:]
        dtype = compute_dtype(extra.dtype)
        e = extra.reshape(m, -1, dim).to(dtype)  # [m, T, D]
        tokens = e.shape[1]
        o1 = out1.reshape(tokens, dim).to(dtype)
        l1 = lse.reshape(tokens).to(dtype)
        u = _products(weights, dtype)
        flat = e.reshape(m * tokens, dim)
        rstd = _key_stats(flat, eps)
        le = torch.mv(flat, u).mul_(rstd).view(m, tokens)
        total = torch.logaddexp(l1, le[0] if m == 1 else torch.logsumexp(le, dim=0))  # [T]
        a0 = (l1 - total).exp_()
        ae = (le - total).exp_()  # [m, T]
        acc = o1 * a0.unsqueeze(1)
        for k in range(m):
            acc.addcmul_(e[k], ae[k].unsqueeze(1))
        ctx.save_for_backward(out1, lse, extra, weights, rstd, le, total)
        ctx.set_materialize_grads(False)
        return acc.to(extra.dtype).view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        out1, lse, extra, weights, rstd, le, total = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None
        m, dim = extra.shape[0], extra.shape[-1]
        dtype = compute_dtype(extra.dtype)
        e = extra.reshape(m, -1, dim).to(dtype)
        tokens = e.shape[1]
        o1 = out1.reshape(tokens, dim).to(dtype)
        l1 = lse.reshape(tokens).to(dtype)
        u = _products(weights, dtype)
        flat = e.reshape(m * tokens, dim)
        a0 = (l1 - total).exp_()
        ae = (le - total).exp_()
        g = grad_out.reshape(tokens, dim).to(dtype)
        d_a0 = (g * o1).sum(dim=-1)  # [T]
        if m == 1:
            d_ae = (g * e[0]).sum(dim=-1).unsqueeze(0)
        else:
            d_ae = torch.bmm(e.transpose(0, 1), g.unsqueeze(2)).squeeze(2).t()  # [m, T]
        mean = a0 * d_a0 + (ae * d_ae).sum(dim=0)  # <G, out> in compute dtype
        d_l1 = a0 * (d_a0 - mean)
        d_le = ae * (d_ae - mean)  # [m, T]
        need = ctx.needs_input_grad
        grad_o1 = (g * a0.unsqueeze(1)).to(out1.dtype).view(out1.shape) if need[0] else None
        grad_l1 = d_l1.to(lse.dtype).view(lse.shape) if need[1] else None
        grad_e = grad_w = None
        d_flat = d_le.view(-1)
        if need[2]:
            coef = (d_flat * le.view(-1)).mul_(rstd.square() * (-1.0 / dim))
            ge = torch.outer(d_flat * rstd, u)
            ge.addcmul_(flat, coef.unsqueeze(1))
            ge = ge.view(m, tokens, dim)
            ge.addcmul_(g.unsqueeze(0), ae.unsqueeze(2))
            grad_e = ge.to(extra.dtype).view(extra.shape)
        if need[3]:
            grad_w = _weights_grad(torch.mv(flat.t(), d_flat * rstd), weights)
        return grad_o1, grad_l1, grad_e, grad_w, None


class _Merge1(torch.autograd.Function):
    """``phase2`` for one extra source (the Block partial): a two-way softmax, so the mix is
    ``lerp(out1, e, a)`` with ``a = sigmoid(le - lse)`` and nothing but ``a`` and the key
    statistics of ``e`` ([T] floats each) is saved."""

    @staticmethod
    def forward(ctx, out1, lse, extra, weights, eps):
        dim = extra.shape[-1]
        dtype = compute_dtype(extra.dtype)
        e = extra.reshape(-1, dim).to(dtype)  # [T, D]
        o1 = out1.reshape(e.shape).to(dtype)
        u = _products(weights, dtype)
        rstd = _key_stats(e, eps)
        le = torch.mv(e, u).mul_(rstd)  # [T]
        a = torch.sigmoid(le - lse.reshape(-1).to(dtype))  # weight of e; out1's is 1 - a
        out = torch.lerp(o1, e, a.unsqueeze(1))
        ctx.save_for_backward(out1, extra, weights, rstd, le, a)
        ctx.lse_dtype = lse.dtype
        ctx.set_materialize_grads(False)
        return out.to(extra.dtype).view(extra.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        out1, extra, weights, rstd, le, a = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None
        dim = extra.shape[-1]
        dtype = compute_dtype(extra.dtype)
        e = extra.reshape(-1, dim).to(dtype)
        o1 = out1.reshape(e.shape).to(dtype)
        g = grad_out.reshape(e.shape).to(dtype)
        u = _products(weights, dtype)
        # out = o1 + a (e - o1): d a = <G, e - o1>; a = sigmoid(le - lse): d le = a (1 - a) d a
        d_le = torch.linalg.vecdot(g, e - o1).mul_(a).mul_(1.0 - a)  # [T]
        need = ctx.needs_input_grad
        grad_o1 = grad_l1 = grad_e = grad_w = None
        if need[0] or need[2]:
            ga = g * a.unsqueeze(1)  # G a: e's share; out1's is G - G a
            if need[0]:
                grad_o1 = (g - ga).to(out1.dtype).view(out1.shape)
        if need[1]:
            grad_l1 = d_le.neg().to(ctx.lse_dtype).view(out1.shape[:-1])
        d_raw = d_le * rstd  # d <e, u>
        if need[2]:
            # d e = G a + r * dle * u - r^2 / D * dle * le * e
            coef = (d_le * le).mul_(rstd.square()).mul_(-1.0 / dim)
            ga.addr_(d_raw, u).addcmul_(e, coef.unsqueeze(1))
            grad_e = ga.to(extra.dtype).view(extra.shape)
        if need[3]:
            grad_w = _weights_grad(torch.mv(e.t(), d_raw), weights)
        return grad_o1, grad_l1, grad_e, grad_w, None


def phase1(blocks: Tensor, weights: Tensor, eps: float = 1e-6) -> tuple[tuple, tuple]:
    """Attend the ``S`` queries over the ``n`` completed blocks in one batched pass.

    Args:
        blocks: ``[n, *batch, D]``, the contiguous store of completed blocks (any float dtype).
        weights: ``[S, 2, D]``, each mixer's pseudo-query ``w_l`` and key gain ``g_l`` (rows
            of the model's ``mixer_weights``: their gradient is one tensor).

    Returns:
        ``(out1, lse)``: S tensors ``[*batch, D]`` and S ``[*batch]``, float32 (float64 for
        float64 blocks); ``out1_l`` is the softmax-weighted sum of the blocks under query
        ``l``, ``lse_l`` the log-sum-exp of its logits.
    """
    check_packed(blocks, weights)
    out1, lse = _Phase1.apply(blocks, weights, eps)
    # unbound once: one backward node stacks the S gradients, where S index ops would each
    # fill a zero tensor of the whole [S, ...] and add it up
    return out1.unbind(0), lse.unbind(0)


def phase2(out1: Tensor, lse: Tensor, extra: Tensor, weights: Tensor, eps: float = 1e-6) -> Tensor:
    """Merge ``extra`` ``[m, *batch, D]`` into one sublayer's phase-1 result by online softmax.

    ``out1`` ``[*batch, D]`` and ``lse`` ``[*batch]`` are that sublayer's entries of
    :func:`phase1`'s results, ``weights`` its ``[2, D]`` (query, gain). Returns the one-pass
    softmax mix over ``blocks ++ extra`` in ``extra``'s dtype.
    """
    check_phase2(out1, lse, extra)
    check_packed_row(weights, extra.shape[-1])
    merge = _Merge1 if extra.shape[0] == 1 else _Phase2
    return merge.apply(out1, lse, extra, weights, eps)
