"""Expert parallelism through DeepSpeed's engine: Megatron's expert groups in DeepSpeed's MoE
registry, so DeepSpeed reduces each gradient over the replicas that hold its parameter.

Megatron-Core builds the expert groups (``parallel_state.initialize_model_parallel``'s
``expert_model_parallel_size``) and marks each expert parameter ``allreduce = False`` when the
experts are split (ep > 1), which DeepSpeed reads as "a MoE parameter" (``is_moe_param``). Its
MoE path then wants to know, per parameter, the name of the expert data-parallel group that
holds the parameter's replicas (``param.group_name``) and finds that group in
``deepspeed.utils.groups``. Its own ``MoE`` modules register them; Megatron's layers do not,
so ``register`` does, before ``deepspeed.initialize``: the engine then broadcasts each expert
from its own replica group at start, and ``ReduceGrads`` (``buffered_allreduce_fallback``)
averages dense gradients over the data-parallel group and expert gradients summed over the
expert data-parallel group divided by the data-parallel size: the mean over the global batch,
as in Megatron's ``DistributedDataParallel``. ``enable`` turns that path on after the engine
is built (DeepSpeed decides ``has_moe_layers`` from its own module types).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.expert_params import is_expert_param


def group_name(dims: ParallelDims) -> str:
    return f"ep_size_{dims.ep}"  # DeepSpeed's own naming of its expert groups


def register(module: torch.nn.Module, dims: ParallelDims) -> bool:
    """Name Megatron's expert groups in DeepSpeed's registry and tag the expert parameters;
    False (nothing done) when the experts are not split."""
    if dims.ep == 1:
        return False
    from deepspeed.utils import groups
    from megatron.core import parallel_state

    name = group_name(dims)
    for registry, ranks, group in (
        (
            groups._EXPERT_DATA_PARALLEL_GROUP,
            groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
            parallel_state.get_expert_data_parallel_group(),
        ),
        (
            groups._EXPERT_PARALLEL_GROUP,
            groups._EXPERT_PARALLEL_GROUP_RANKS,
            parallel_state.get_expert_model_parallel_group(),
        ),
    ):
        registry[name] = group
        ranks[name] = dist.get_process_group_ranks(group)
    for param in module.parameters():
        if is_expert_param(param):
            param.group_name = name
    return True


def enable(engine) -> None:
    """DeepSpeed's MoE gradient path on an engine built after ``register``."""
    engine.has_moe_layers = True
