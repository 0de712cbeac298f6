"""Tensor-parallel shards <-> full tensors, following Megatron-Core's own layout.

Megatron marks a sharded parameter with ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``. With stride ``s`` the full tensor is cut into ``s * T`` equal chunks along
``partition_dim`` and rank ``r`` holds chunks ``r, r + T, r + 2T, ...`` (SwiGLU's fc1 uses
``s = 2`` so each rank holds matching gate and up halves). These two functions invert each other
and are what checkpoints, export and the equivalence tests use to speak of one model whatever
the tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_of(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (of ``size`` ranks)."""
    if size == 1:
        return full
    chunks = torch.chunk(full, stride * size, dim=dim)
    return torch.cat(chunks[rank::size], dim=dim)


def full_from_shards(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Inverse of ``shard_of`` given every rank's shard in rank order."""
    size = len(shards)
    if size == 1:
        return shards[0]
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(size)], dim=dim)


def gather_full(tensor: torch.Tensor, like: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """The full tensor of ``tensor``, sharded like the parameter ``like`` (default: itself).

    Collective over ``group`` (the tensor-parallel group) when ``like`` is sharded and
    ``tensor`` has its shape (a parameter, or its AdamW moments); anything else (a replicated
    parameter, a scalar step count, no group) is returned as a detached copy.
    """
    like = tensor if like is None else like
    tensor = tensor.detach()
    if (
        not is_sharded(like)
        or tensor.shape != like.shape
        or group is None
        or dist.get_world_size(group) == 1
    ):
        return tensor.clone()
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return full_from_shards(shards, like.partition_dim, getattr(like, "partition_stride", 1))
