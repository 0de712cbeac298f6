"""Sequence parallelism's gradient reduction over the tensor ranks, before DeepSpeed's own.

Under Megatron's sequence parallelism every tensor rank runs the parts outside the
tensor-parallel matmuls (norms, the depth mixes, the MoE router) on its split of the sequence,
so a parameter replicated over the tensor ranks (not ``tensor_model_parallel``: norm gains,
the mixers' queries and key gains, the router) gets, on each rank, the gradient of that rank's
positions only. Megatron's ``finalize_model_grads`` sums such gradients over the tensor group;
DeepSpeed, which runs the schedule here, does not know them. ``install`` wraps this engine
instance's ``ReduceGrads`` handler (as ``single_replica.py`` replaces it): the sum over the
tensor group first (one flat all-reduce), then whatever reduction the handler did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def replicated_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters every tensor rank holds whole."""
    return [
        p
        for p in module.parameters()
        if p.requires_grad and not getattr(p, "tensor_model_parallel", False)
    ]


def install(engine, module: torch.nn.Module, tp_group) -> None:
    """Sum the replicated parameters' gradients over ``tp_group`` at each ``ReduceGrads``.
    Call after ``skip_single_replica_reduction``, which replaces the handler."""
    from deepspeed.runtime.pipe import schedule

    params = replicated_params(module)
    handlers = dict(engine._INSTRUCTION_MAP)
    reduce = handlers[schedule.ReduceGrads]

    def reduce_grads(self) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=tp_group)
            for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(summed)
        reduce(self)

    handlers[schedule.ReduceGrads] = reduce_grads
    engine._INSTRUCTION_MAP = handlers
