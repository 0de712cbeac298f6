"""Two-phase depth attention on Triton kernels, registered as PyTorch custom ops.

``phase1(blocks, queries, norm_weights, eps) -> (out1, lse)`` attends the ``S`` pseudo-queries
of one block's sublayers over the contiguous store of completed blocks; ``phase2(out1, lse,
extra, query, norm_weight, eps) -> out`` merges one sublayer's sources outside the store (the
partial block) by online softmax and casts once. The kernels of
:mod:`attnres_dist.ops.triton_kernels` run inside ``torch.library.triton_op``s
(``attnres::triton_phase1``, ``attnres::triton_phase2`` and their backwards) whose gradients
are registered with ``register_autograd``: eager calls and compiled graphs run the same
kernels, and the compiler sees them (no graph break). The ops take the queries' products with
their gains, ``u = g * w``, formed in torch around them, so autograd carries ``du`` back to
both.

Saved for backward: phase 1 keeps the store itself (no copy), ``u`` and its own outputs
``out1`` / ``lse`` (alive anyway until phase 2's backward); phase 2 keeps its inputs and one
float per token (the merged log-sum-exp). No normalised keys, logits or ``[S, n, T, D]``
intermediates are kept; backward recomputes ``r`` and the logits from the sources.

"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from attnres_dist.ops import triton_kernels as K


def _check_device(t: Tensor) -> None:
    if t.device.type != "cuda" and not K.interpreting():
        raise ValueError(
            f"the triton depth-attention kernels need CUDA tensors (got {t.device}); "
            "set TRITON_INTERPRET=1 to run them on the CPU through Triton's interpreter"
        )


def _check_phase1(blocks: Tensor, queries: Tensor, norm_weights: Tensor) -> None:
    if blocks.dim() < 2 or blocks.shape[0] < 1 or blocks.shape[-1] < 1:
        raise ValueError(f"blocks must be [n >= 1, *batch, D], got {tuple(blocks.shape)}")
    if not blocks.is_floating_point():
        raise ValueError(f"blocks must be floating point, got {blocks.dtype}")
    dim = blocks.shape[-1]
    for name, t in (("queries", queries), ("norm_weights", norm_weights)):
        if t.dim() != 2 or t.shape[1] != dim or t.shape[0] < 1:
            raise ValueError(f"{name} must be [S, D] with D = {dim}, got {tuple(t.shape)}")
        if t.device != blocks.device:
            raise ValueError(f"{name} is on {t.device} but blocks are on {blocks.device}")
    if queries.shape != norm_weights.shape:
        raise ValueError(
            f"queries {tuple(queries.shape)} and norm_weights {tuple(norm_weights.shape)} differ"
        )
    _check_device(blocks)


def _check_phase2(out1: Tensor, lse: Tensor, extra: Tensor, query: Tensor, weight: Tensor) -> None:
    if extra.dim() < 2 or extra.shape[0] < 1:
        raise ValueError(f"extra must be [m >= 1, *batch, D], got {tuple(extra.shape)}")
    if out1.shape != extra.shape[1:]:
        raise ValueError(f"out1 must be {tuple(extra.shape[1:])}, got {tuple(out1.shape)}")
    if lse.shape != extra.shape[1:-1]:
        raise ValueError(f"lse must be {tuple(extra.shape[1:-1])}, got {tuple(lse.shape)}")
    dim = extra.shape[-1]
    for name, t in (("query", query), ("norm_weight", weight)):
        if t.shape != (dim,):
            raise ValueError(f"{name} must be [D] = [{dim}], got {tuple(t.shape)}")
    for name, t in (("out1", out1), ("lse", lse), ("query", query), ("norm_weight", weight)):
        if t.device != extra.device:
            raise ValueError(f"{name} is on {t.device} but extra is on {extra.device}")
    _check_device(extra)


def _launch(kernel, grid, device: torch.device, *args, **meta) -> None:
    # Triton launches on the current CUDA device: make it the tensors' one.
    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        wrap_triton(kernel)[grid](*args, **meta)


def _launch_groups(num_queries: int, tokens: int, dim: int):
    block_s, block_t, block_d = K.tile_sizes(num_queries, tokens, dim)
    warps = K.num_warps(block_s * block_t * block_d)
    groups = [(s, min(s + block_s, num_queries)) for s in range(0, num_queries, block_s)]
    return groups, block_s, block_t, block_d, warps


@triton_op("attnres::triton_phase1", mutates_args=())
def _phase1(store: Tensor, u: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``out1`` ``[S, T, D]`` and ``lse`` ``[S, T]`` (float32) of the contiguous store
    ``[n, *batch, D]`` under ``u`` ``[S, D]`` (float32)."""
    n, dim = store.shape[0], store.shape[-1]
    tokens = store[0].numel() // dim
    num_q = u.shape[0]
    out1 = torch.empty(num_q, tokens, dim, dtype=torch.float32, device=store.device)
    lse = torch.empty(num_q, tokens, dtype=torch.float32, device=store.device)
    groups, block_s, block_t, block_d, warps = _launch_groups(num_q, tokens, dim)
    grid = (triton_cdiv(tokens, block_t),)
    for s0, s1 in groups:
        _launch(K.phase1_fwd_kernel(), grid, store.device,
            store, u[s0:s1], out1[s0:s1], lse[s0:s1], n, tokens, dim, s1 - s0, eps,
            BLOCK_S=block_s, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
    return out1, lse


@triton_op("attnres::triton_phase1_backward", mutates_args=())
def _phase1_backward(
    store: Tensor,
    u: Tensor,
    out1: Tensor,
    lse: Tensor,
    g_out1: Tensor,
    g_lse: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """The gradients of the store (its dtype) and of ``u`` (float32)."""
    n, dim = store.shape[0], store.shape[-1]
    num_q, tokens = out1.shape[0], out1.shape[1]
    has_g_lse = g_lse is not None
    g_lse = g_lse if has_g_lse else lse  # (not read)
    groups, block_s, block_t, block_d, warps = _launch_groups(num_q, tokens, dim)
    # Several query groups add into one gradient: accumulate it in float32.
    acc_dtype = store.dtype if len(groups) == 1 else torch.float32
    d_blocks = torch.empty(store.shape, dtype=acc_dtype, device=store.device)
    tiles = triton_cdiv(tokens, block_t)
    programs = K.persistent_programs(tiles, store.device)
    du = torch.empty(num_q, dim, dtype=torch.float32, device=store.device)
    for i, (s0, s1) in enumerate(groups):
        part = torch.empty(programs, s1 - s0, dim, dtype=torch.float32, device=store.device)
        _launch(K.phase1_bwd_kernel(), (programs,), store.device,
            store, u[s0:s1], out1[s0:s1], lse[s0:s1], g_out1[s0:s1], g_lse[s0:s1],
            d_blocks, part, n, tokens, dim, s1 - s0, eps, tiles,
            HAS_G_LSE=has_g_lse, ACCUMULATE=i > 0,
            BLOCK_S=block_s, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps,
        )  # fmt: skip
        du[s0:s1] = part.sum(dim=0)
    return d_blocks.to(store.dtype), du


def _phase1_setup(ctx, inputs, output):
    store, u, eps = inputs
    ctx.save_for_backward(store, u, *output)
    ctx.eps = eps


def _phase1_grad(ctx, g_out1, g_lse):
    store, u, out1, lse = ctx.saved_tensors
    g_out1 = torch.zeros_like(out1) if g_out1 is None else g_out1.contiguous()
    g_lse = None if g_lse is None else g_lse.float().contiguous()
    d_blocks, du = _phase1_backward(store, u, out1, lse, g_out1, g_lse, ctx.eps)
    return d_blocks, du, None


_phase1.register_autograd(_phase1_grad, setup_context=_phase1_setup)


@triton_op("attnres::triton_phase2", mutates_args=())
def _phase2(o1: Tensor, z: Tensor, sources: Tensor, u: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The merge ``[T, D]`` (the sources' dtype) of phase 1's ``o1`` ``[T, D]`` and ``z``
    ``[T]`` (float32) with the contiguous ``sources`` ``[m, *batch, D]`` under ``u`` ``[D]``
    (float32), and the merged log-sum-exp ``[T]``."""
    m, dim = sources.shape[0], sources.shape[-1]
    tokens = o1.shape[0]
    out = torch.empty(tokens, dim, dtype=sources.dtype, device=sources.device)
    lse_tot = torch.empty(tokens, dtype=torch.float32, device=sources.device)
    _, block_t, block_d = K.tile_sizes(1, tokens, dim)
    _launch(K.phase2_fwd_kernel(), (triton_cdiv(tokens, block_t),), sources.device,
        o1, z, sources, u, out, lse_tot, m, tokens, dim, eps,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=K.num_warps(block_t * block_d),
    )  # fmt: skip
    return out, lse_tot


@triton_op("attnres::triton_phase2_backward", mutates_args=())
def _phase2_backward(
    grad: Tensor, o1: Tensor, z: Tensor, lse_tot: Tensor, sources: Tensor, u: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``o1``, ``z`` (float32), the sources (their dtype) and ``u``."""
    tokens, dim = o1.shape
    _, block_t, block_d = K.tile_sizes(1, tokens, dim)
    tiles = triton_cdiv(tokens, block_t)
    programs = K.persistent_programs(tiles, o1.device)
    d_out1 = torch.empty_like(o1)
    d_lse = torch.empty_like(z)
    d_extra = torch.empty_like(sources)
    part = torch.empty(programs, dim, dtype=torch.float32, device=o1.device)
    _launch(K.phase2_bwd_kernel(), (programs,), o1.device,
        grad, o1, z, lse_tot, sources, u, d_out1, d_lse, d_extra, part,
        sources.shape[0], tokens, dim, eps, tiles,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=K.num_warps(block_t * block_d),
    )  # fmt: skip
    return d_out1, d_lse, d_extra, part.sum(dim=0)


def _phase2_setup(ctx, inputs, output):
    o1, z, sources, u, eps = inputs
    ctx.save_for_backward(o1, z, output[1], sources, u)
    ctx.eps = eps


def _phase2_grad(ctx, grad_out, _grad_lse):
    o1, z, lse_tot, sources, u = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None
    grad = grad_out.contiguous()
    return (*_phase2_backward(grad, o1, z, lse_tot, sources, u, ctx.eps), None)


_phase2.register_autograd(_phase2_grad, setup_context=_phase2_setup)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def phase1(
    blocks: Tensor, queries: Tensor, norm_weights: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Attend ``queries`` ``[S, D]`` over the store ``blocks`` ``[n, *batch, D]``.

    Returns ``out1`` ``[S, *batch, D]`` (float32, softmax-weighted sum of the blocks) and
    ``lse`` ``[S, *batch]`` (float32 log-sum-exp of the logits); differentiable w.r.t. all three
    tensor arguments.
    """
    _check_phase1(blocks, queries, norm_weights)
    u = (norm_weights.float() * queries.float()).contiguous()
    out1, lse = _phase1(blocks.contiguous(), u, float(eps))  # the contiguous store: a no-op
    return out1.view(u.shape[0], *blocks.shape[1:]), lse.view(u.shape[0], *blocks.shape[1:-1])


def phase2(
    out1: Tensor,
    lse: Tensor,
    extra: Tensor,
    query: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """Merge the sources ``extra`` ``[m, *batch, D]`` into one sublayer's phase-1 result.

    Equals one-pass depth attention over the store's blocks followed by ``extra``; the output
    has ``extra``'s dtype. Differentiable w.r.t. every tensor argument.
    """
    _check_phase2(out1, lse, extra, query, norm_weight)
    dim = extra.shape[-1]
    o1 = out1.reshape(-1, dim).float().contiguous()
    z = lse.reshape(-1).float().contiguous()
    u = (norm_weight.float() * query.float()).contiguous()
    out, _ = _phase2(o1, z, extra.contiguous(), u, float(eps))
    return out.view(extra.shape[1:])
