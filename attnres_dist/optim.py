"""Optimizer and learning-rate schedule, shared by the single-process and pipelined engines.

AdamW from ``torch.optim`` (DeepSpeed's config-declared Adam JIT-builds a fused op and Megatron's
optimizer is CUDA-bound; DESIGN.md section 4), with weight decay on matrices only: norms' gains
and the depth-attention queries and key gains (vectors, packed per layer into one tensor marked
``no_weight_decay``) are not decayed. torch's AdamW runs its fused
kernel (``fused=True``, CPU and CUDA): one call updates every parameter of a group, where the
default per-parameter loop pays a dozen small ops per tensor (a model with depth attention has
two small vectors per sublayer). Linear warm-up then cosine
decay to ``min_lr``, as a ``LambdaLR`` that both engines step once per optimizer step.
Where the runtime chose apex (GPU), its FusedAdam in AdamW mode takes torch's place.
"""

from __future__ import annotations

import math

import torch

from attnres_dist.config import OptimConfig
from attnres_dist.runtime import RuntimeChoice


def lr_factor(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``optim.lr`` for optimizer step ``step`` (0-based)."""
    if optim.warmup_steps > 0 and step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    floor = optim.min_lr / optim.lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decayed and undecayed parameters; experts split over expert-parallel ranks (tagged with
    their group's ``group_name``, ``pipeline/expert_groups.py``) in groups of their own, marked
    as DeepSpeed's optimizer wrappers read MoE groups (``moe``, ``name``)."""
    groups: dict[tuple, list] = {}
    for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        if param.requires_grad:
            exempt = param.ndim < 2 or getattr(param, "no_weight_decay", False)
            groups.setdefault((exempt, getattr(param, "group_name", None)), []).append(param)
    out = []
    for exempt, expert_group in sorted(groups, key=lambda k: (k[0], k[1] or "")):
        group = {
            "params": groups[exempt, expert_group],
            "weight_decay": 0.0 if exempt else weight_decay,
        }
        if expert_group is not None:
            group |= {"moe": True, "name": expert_group}
        out.append(group)
    return out or [{"params": [], "weight_decay": weight_decay}]


def fused_adamw_supported(model: torch.nn.Module) -> bool:
    """Whether torch's fused AdamW kernel takes every trainable parameter of ``model``."""
    params = [p for p in model.parameters() if p.requires_grad]
    return bool(params) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )


def build_optimizer(
    model: torch.nn.Module,
    optim: OptimConfig,
    total_steps: int,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    **extra,
):
    """The optimizer and its LambdaLR schedule, for both engines.

    ``optimizer_class``: an AdamW-compatible class (torch's AdamW; the pipeline engine passes
    the global-norm-clipping one around the runtime's choice, with its ``extra`` arguments).
    """
    if issubclass(optimizer_class, torch.optim.AdamW):
        extra.setdefault("fused", fused_adamw_supported(model))
    optimizer = optimizer_class(
        param_groups(model, optim.weight_decay),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        **extra,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, optim, total_steps)
    )
    return optimizer, scheduler


def adam_class(choice: RuntimeChoice) -> type[torch.optim.Optimizer]:
    """apex FusedAdam in AdamW mode (decoupled weight decay, as torch.optim.AdamW) where the
    runtime chose apex, else torch's AdamW."""
    if choice.optimizer.value == "apex":
        from apex.optimizers import FusedAdam

        # adam_w_mode defaults to True: the same update as torch.optim.AdamW
        return FusedAdam
    return torch.optim.AdamW
