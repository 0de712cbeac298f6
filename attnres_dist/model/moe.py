"""The mixture-of-experts MLP sublayer: Megatron-Core's ``MoELayer`` where ``model.moe`` says.

Megatron builds the router (``TopKRouter``), the token dispatcher (all-to-all or all-gather
over the expert-parallel group), the experts (``SequentialMLP``: one SwiGLU MLP per local
expert) and the shared expert; the AttnRes layer calls ``layer.mlp`` as it calls a dense MLP,
so the depth mix in front of it is the same. This module owns what is the project's:

* ``moe_layer_spec``: the local layer spec with the MoE MLP;
* ``init_experts``: each expert drawn under its own seed by its global index (the shared
  expert under its own), so expert ``g`` has the same weights whichever rank holds it, and
  every expert-parallel layout starts from the single-process model's parameters;
* ``set_aux_loss_scale``: the router's auxiliary and z-losses reach the backward through
  Megatron's ``MoEAuxLossAutoScaler`` on the stage that holds the layer; their gradient is
  scaled as the main loss is (1 / micro-batches per step; the data-parallel mean does the rest);
* ``RoutingStats``: per MoE layer, the balancing losses Megatron tracks and the tokens each
  expert received, summed over a logging window and reduced over the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attnres_dist.config import ModelConfig
from attnres_dist.parallel.comm_device import comm_device
from attnres_dist.parallel.tp_shards import is_sharded, shard_of


def moe_layer_spec(num_experts: int, qk_norm: bool = False):
    """Megatron-Core's local layer spec with the MoE MLP (SequentialMLP experts)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=qk_norm,
    )


def is_moe(mlp) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return isinstance(mlp, MoELayer)


@torch.no_grad()
def init_experts(mlp, seeded, layer_index: int) -> None:
    """Draw each local expert's weights (and the shared expert's) under its own seed; as
    Megatron's CPU initialisation, from the config's init methods. ``seeded(name)``: the
    builder's seed context (``model/gpt.py``)."""
    config = mlp.config
    tp = mlp.experts.tp_group  # the experts' tensor-parallel group (Megatron: tp's ranks)
    # Megatron's local_expert_indices are the global indices of this rank's experts
    for index, expert in zip(mlp.local_expert_indices, mlp.experts.local_experts, strict=True):
        with seeded(f"layer.{layer_index}.expert.{index}"):
            _draw(expert, config, tp.rank(), tp.size())
    if mlp.shared_experts is not None:
        shared = mlp.shared_experts.tp_group
        with seeded(f"layer.{layer_index}.shared_expert"):
            _draw(mlp.shared_experts, config, shared.rank(), shared.size())


def _draw(mlp, config, rank: int, size: int) -> None:
    """The full weights drawn, this tensor rank's shards kept (Megatron's CPU initialisation)."""
    for linear, init in (
        (mlp.linear_fc1, config.init_method),
        (mlp.linear_fc2, config.output_layer_init_method),
    ):
        weight = linear.weight
        if not is_sharded(weight) or size == 1:
            init(weight)
            continue
        dim, stride = weight.partition_dim, weight.partition_stride
        full = torch.empty(
            [n * size if d == dim else n for d, n in enumerate(weight.shape)], dtype=torch.float32
        )
        init(full)
        weight.copy_(shard_of(full, dim, stride, rank, size))


def set_aux_loss_scale(micro_batches: int, device) -> None:
    """The router losses' gradient scale for a step of ``micro_batches`` micro-batches."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches, device=device))


def _in_backward() -> bool:
    """A forward running inside backward is a recompute (activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class RoutingStats:
    """Routing statistics of a model's (or a stage's) MoE layers over a logging window."""

    def __init__(self, root: torch.nn.Module, model: ModelConfig):
        """``root``: the model, or this rank's pipeline stage. The first window starts here."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        self.num_layers, self.num_experts = model.num_layers, model.moe.num_experts
        self.top_k = model.moe.top_k
        # on the device collectives use (the routing's own: counted without a host wait)
        counter = {"dtype": torch.float64, "device": comm_device()}
        self.tokens = torch.zeros(self.num_layers, self.num_experts, **counter)
        self.routed = torch.zeros(self.num_layers, **counter)  # tokens routed
        self.calls = torch.zeros(self.num_layers, **counter)  # training forwards
        self.moe_layers = []
        for module in root.modules():
            if is_moe(module):  # Megatron numbers layers from 1
                self.moe_layers.append(module.layer_number - 1)
                module.router.register_forward_hook(self._hook(module.layer_number - 1))

    def _hook(self, index: int):
        def count(router, inputs, outputs):
            if not router.training or _in_backward():
                return
            _, routing_map = outputs
            self.tokens[index] += routing_map.sum(0).to(self.tokens)
            self.routed[index] += routing_map.shape[0]
            self.calls[index] += 1

        return count

    def read(self) -> dict[str, float]:
        """Per MoE layer and averaged over them, for the window since the last read: each
        balancing loss Megatron tracks (mean per micro-batch), the expert load (the busiest
        expert's tokens over a fair share: 1 = balanced) and the share of token-expert pairs
        the capacity dropped. Collective over every rank (each layer lives on one stage, and
        its micro-batches on every data-parallel rank: sums over the world)."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        tracker = get_moe_layer_wise_logging_tracker()
        names = sorted(tracker)
        losses = torch.zeros(len(names), self.num_layers, dtype=torch.float64, device=comm_device())
        for k, name in enumerate(names):
            losses[k] = tracker[name]["values"].detach().to(losses)
        packed = torch.cat([losses.flatten(), self.tokens.flatten(), self.routed, self.calls])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        packed = packed.cpu()  # one wait for the device, on the steps that log
        losses, tokens, routed, calls = packed.split(
            [losses.numel(), self.tokens.numel(), self.num_layers, self.num_layers]
        )
        losses, tokens = losses.view(len(names), -1), tokens.view(self.num_layers, -1)
        values = {}
        for i in self.moe_layers:
            if calls[i] == 0:
                continue
            prefix, pairs = f"moe/layer{i}", routed[i] * self.top_k
            for k, name in enumerate(names):
                values[f"{prefix}/{name}"] = float(losses[k, i] / calls[i])
            values[f"{prefix}/expert_load_max"] = float(tokens[i].max() * self.num_experts / pairs)
            values[f"{prefix}/dropped"] = float(1 - tokens[i].sum() / pairs)
        for key in (*names, "expert_load_max", "dropped"):
            per_layer = [v for k, v in values.items() if k.endswith("/" + key)]
            if per_layer:
                values[f"moe/{key}"] = sum(per_layer) / len(per_layer)
        clear_aux_losses_tracker()
        for counter in (self.tokens, self.routed, self.calls):
            counter.zero_()
        return values
