"""Expert parallelism through DeepSpeed's engine: Megatron's expert groups in DeepSpeed's MoE
registry, so DeepSpeed reduces each gradient over the replicas that hold its parameter.

Megatron-Core builds the expert groups (``parallel_state.initialize_model_parallel``'s
``expert_model_parallel_size``) and marks each expert parameter ``allreduce = False`` when the
experts are split (ep > 1), which DeepSpeed reads as "a MoE parameter" (``is_moe_param``). Its
MoE path then wants to know, per parameter, the name of the expert data-parallel group that
holds the parameter's replicas (``param.group_name``) and finds that group in
``deepspeed.utils.groups``. Its own ``MoE`` modules register them; Megatron's layers do not,
so ``register`` does, before ``deepspeed.initialize`` (``optim.param_groups`` then puts the
tagged experts in MoE param groups of their own, and ``moe_engine`` lets the engine know): the
engine then broadcasts each expert from its own replica group at start, and ``ReduceGrads``
(``buffered_allreduce_fallback``) averages dense gradients over the data-parallel group and
expert gradients summed over the expert data-parallel group divided by the data-parallel size:
the mean over the global batch, as in Megatron's ``DistributedDataParallel``; the bf16 and
ZeRO-1 wrappers partition and reduce each MoE group over its expert data-parallel group.
"""

from __future__ import annotations

import contextlib

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


@contextlib.contextmanager
def moe_engine(split_experts: bool):
    """DeepSpeed engines built inside know they hold MoE parameters (``has_moe_layers``),
    as they do for DeepSpeed's own MoE modules, so that their bf16 and ZeRO-1 optimizer
    wrappers take the MoE param groups (``optim.param_groups``) over their expert
    data-parallel groups. DeepSpeed decides it from its module types only; here it is set
    right after that decision, for the engines built in the ``with`` block."""
    if not split_experts:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    configure = DeepSpeedEngine._configure_distributed_model

    def with_experts(self, model):
        configure(self, model)
        self.has_moe_layers = True

    DeepSpeedEngine._configure_distributed_model = with_experts
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = configure
