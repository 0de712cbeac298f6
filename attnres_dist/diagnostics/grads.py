"""Gradient norms per sublayer, transformer layer and AttnRes block.

A transformer layer's parameters split into its two sublayers: the attention sublayer owns
``input_layernorm``, ``self_attention`` and the depth mixer that feeds it (row 0 of the layer's
packed ``mixer_weights``); the MLP sublayer owns ``pre_mlp_layernorm``, ``mlp`` and its mixer
(row 1). Anything else a layer may grow counts towards the layer only. ``GradMeter`` reads
squared gradient norms of the local layers' parameters at one moment (the accumulated, not yet
clipped gradients of an optimizer step); ``norms`` turns the squared sums of all stages into
norms per sublayer, layer and block.

Under tensor parallelism a sharded parameter counts on every tensor rank (its shards add up)
and a replicated one only on tensor rank 0, so the squared sums of a data-parallel replica's
ranks add up to the norm of the full model.
"""

from __future__ import annotations

import math
import time

import torch

from attnres_dist.config.block_plan import BlockPlan

_ATTENTION_PARTS = ("layer.input_layernorm.", "layer.self_attention.")
_MLP_PARTS = ("layer.pre_mlp_layernorm.", "layer.mlp.")
_MIXERS = "mixer_weights"  # [2, 2, D]: row 0 the attention's mixer, row 1 the MLP's


def sublayer_of(layer_index: int, name: str) -> int | None:
    """Global sublayer number (1-based) owning parameter ``name`` of layer ``layer_index``."""
    if name.startswith(_ATTENTION_PARTS):
        return 2 * layer_index + 1
    if name.startswith(_MLP_PARTS):
        return 2 * layer_index + 2
    return None


def _entries(layer_index: int, name: str, param) -> list[tuple]:
    """(layer index, sublayer or None, parameter, row or None) for each part of ``name``."""
    if name == _MIXERS:
        first = 2 * layer_index + 1
        return [(layer_index, first + row, param, row) for row in range(param.shape[0])]
    return [(layer_index, sublayer_of(layer_index, name), param, None)]


class GradMeter:
    """Squared gradient norms of the given ``AttnResLayer`` modules, grouped by sublayer."""

    def __init__(self, layers, tp_rank: int = 0):
        # (layer index, sublayer or None, parameter, row or None) for every parameter (or
        # row of one) this rank counts
        self.params = []
        for layer in layers:
            for name, p in layer.named_parameters():
                if tp_rank == 0 or getattr(p, "tensor_model_parallel", False):
                    self.params += _entries(layer.layer_index, name, p)
        self._latest: dict[int, torch.Tensor] = {}
        self._handles = []
        self.seconds = 0.0  # wall time spent reading gradients since the last attach/read

    @staticmethod
    def _sq(grad: torch.Tensor) -> torch.Tensor:
        """Squared norm of each row of ``grad`` (a 1-D result) or of the whole of it."""
        sq = grad.detach().double().pow(2)
        return sq.flatten(1).sum(1) if grad.dim() > 1 else sq.sum()

    def read(self) -> dict:
        """Squared norms of the parameters' current ``.grad`` (None grads count as zero)."""
        start = time.perf_counter()
        grads = {id(p): self._sq(p.grad) for p in self._unique() if p.grad is not None}
        out = self._group(grads)
        self.seconds = time.perf_counter() - start
        return out

    # -- for engines whose clipping point has no hook: remember every accumulation's result --

    def attach(self) -> None:
        """Record each parameter's gradient after every accumulation into ``.grad``.

        The last value recorded is the step's accumulated gradient before any clipping (which
        happens after the last backward), whatever the number of micro-batches.
        """
        self._latest.clear()
        self.seconds = 0.0
        for p in self._unique():
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_accumulate))

    def _unique(self) -> list:
        return list({id(p): p for _, _, p, _ in self.params}.values())

    def _on_accumulate(self, p: torch.Tensor) -> None:
        start = time.perf_counter()
        self._latest[id(p)] = self._sq(p.grad)
        self.seconds += time.perf_counter() - start

    def detach(self) -> dict:
        """Remove the hooks; squared norms of the last accumulated gradients."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        start = time.perf_counter()
        out = self._group(self._latest)
        self.seconds += time.perf_counter() - start
        return out

    def _group(self, sq_by_param: dict[int, torch.Tensor]) -> dict:
        sublayers: dict[int, float] = {}
        other: dict[int, float] = {}
        for layer_index, sublayer, p, row in self.params:
            sq = sq_by_param.get(id(p))
            value = 0.0 if sq is None else float(sq.sum() if row is None else sq[row])
            if sublayer is None:
                other[layer_index] = other.get(layer_index, 0.0) + value
            else:
                sublayers[sublayer] = sublayers.get(sublayer, 0.0) + value
        return {"sublayers": sublayers, "other": other}


def norms(parts: list[dict], plan: BlockPlan) -> dict:
    """Gradient norms from the squared sums of every rank of one data-parallel replica.

    Returns lists indexed by sublayer (``L``), layer (``num_layers``) and block (``N``; empty
    for the baseline, which has no blocks), plus the norm over all transformer layers. A value
    no rank reported is None.
    """
    L = plan.num_sublayers
    sub_sq: list[float | None] = [None] * L
    other_sq = [0.0] * plan.num_layers
    for part in parts:
        for i, value in part["sublayers"].items():
            i = int(i)
            sub_sq[i - 1] = (sub_sq[i - 1] or 0.0) + value
        for layer, value in part["other"].items():
            other_sq[int(layer)] += value

    def root(values):
        if any(v is None for v in values):
            return None
        return math.sqrt(sum(values))

    layers = [root([sub_sq[2 * n], sub_sq[2 * n + 1], other_sq[n]]) for n in range(plan.num_layers)]
    blocks = []
    if plan.mode != "baseline":
        size = plan.effective_block_size
        blocks = [root(sub_sq[start : start + size]) for start in range(0, L, size)]
    return {
        "sublayers": [None if v is None else math.sqrt(v) for v in sub_sq],
        "layers": layers,
        "blocks": blocks,
        "layers_total": root([*sub_sq, *other_sq]),
    }
