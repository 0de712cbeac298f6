"""Which parameters are experts split over expert-parallel ranks, and their global names.

Megatron-Core marks each expert parameter ``allreduce = False`` when a MoE layer's experts are
split over ranks (ep > 1): its replicas are then the ranks of the expert data-parallel group,
not the data-parallel one. A rank holds experts ``first, .., first + local - 1`` of each MoE
layer and names them ``local_experts.0 ..``; checkpoints and exports name them by the global
index, so any expert-parallel layout reads any other's.
"""

from __future__ import annotations

import re

import torch

_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")


def is_expert_param(param: torch.Tensor) -> bool:
    """A parameter of an expert split over expert-parallel ranks (Megatron's mark)."""
    return getattr(param, "allreduce", True) is False


def global_expert_name(name: str, first_expert: int) -> str:
    """``name`` with its local expert index (if any) made global on a rank whose first expert
    is ``first_expert``."""
    if first_expert == 0:
        return name
    return _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + first_expert}{m[3]}", name)
