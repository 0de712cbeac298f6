"""What crosses a model chunk's edges under virtual stages: the ``ChunkBoundary`` interface.

With virtual stages (``parallel.schedule`` dualpipev | interleaved) a rank runs several model
chunks (``virtual_layout.py``). At a chunk's edges the virtual module does not apply the
activation contract itself; it asks the rank's boundary object, so the naive contract and a
cross-stage cache are interchangeable:

* ``receive(chunk, micro_batch, payload)``: before the chunk's first part (a layer or the final
  aggregation), the tensor that came from chunk - 1 -> the full ``DepthState`` it needs;
* ``send(chunk, micro_batch, state)``: after its last part, the state -> the one tensor
  ``[k, s, b, h]`` for chunk + 1;
* ``backward_extras(chunk, micro_batch)``: extra (tensors, gradients) to back-propagate with the
  chunk's outputs; ``after_backward(chunk, micro_batch)`` right after that backward pass;
* ``check_empty()``: at the optimizer step and after an evaluation, raise if anything is kept.

``cached`` says which payload shapes the boundary sends (``CachePlan.phase_shapes``): the
engine allocates its receives from the plan, without exchanging shapes.

``NaiveBoundary`` is the plain contract at every cut: all completed blocks plus the partial
block travel, nothing is kept between chunks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model.depth_state import DepthState
from attnres_dist.pipeline.contract import pack, unpack
from attnres_dist.pipeline.virtual_layout import VirtualLayout


class ChunkBoundary(Protocol):
    cached: bool

    def receive(self, chunk: int, micro_batch: int, payload: torch.Tensor) -> DepthState: ...

    def send(self, chunk: int, micro_batch: int, state: DepthState) -> torch.Tensor: ...

    def backward_extras(
        self, chunk: int, micro_batch: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...

    def after_backward(self, chunk: int, micro_batch: int) -> None: ...

    def check_empty(self) -> None: ...


class NaiveBoundary:
    """The activation contract at each chunk's cut (``contract.pack`` / ``contract.unpack``)."""

    cached = False

    def __init__(self, layout: VirtualLayout, plan: BlockPlan):
        self.layout, self.plan = layout, plan

    def receive(self, chunk: int, micro_batch: int, payload: torch.Tensor) -> DepthState:
        layers = self.layout.layers_before(chunk)
        where = f"boundary into chunk {chunk} (after {layers} layers, micro-batch {micro_batch})"
        return unpack(payload, self.plan, layers, where)

    def send(self, chunk: int, micro_batch: int, state: DepthState) -> torch.Tensor:
        return pack(state)

    def backward_extras(self, chunk: int, micro_batch: int):
        return [], []

    def after_backward(self, chunk: int, micro_batch: int) -> None:
        pass

    def check_empty(self) -> None:
        pass
