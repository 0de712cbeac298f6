"""The depth-attention state that flows from layer to layer within one forward pass.

``DepthState`` holds the completed block representations (``b_0`` = embedding first), the
partial block of the block being filled (or None right after a block closed), and how many
transformer layers have been applied. It is created by the embedding for one micro-batch and
dropped after the head: nothing survives between micro-batches, batches, or train and eval.

With Megatron's document options the state also carries the micro-batch's ``DocumentLayout``
(per-sample positions and attention mask, ``model/document_masks.py``); it is data, not a
source, and every layer hands it on unchanged.

Baseline mode uses the same container with no completed blocks and the running hidden state as
the partial, so every layer speaks one interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DepthState:
    completed: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    layers_done: int = 0
    layout: Any = None  # DocumentLayout or None (plain causal attention, positions 0 .. s-1)

    def sources(self) -> list[torch.Tensor]:
        """What the next depth attention reads: completed blocks, then the partial block."""
        out = list(self.completed)
        if self.partial is not None:
            out.append(self.partial)
        return out

    @property
    def width(self) -> int:
        return len(self.completed) + int(self.partial is not None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.sources())

    @staticmethod
    def from_tensors(
        tensors, num_completed: int, has_partial: bool, layers_done: int, layout=None
    ) -> DepthState:
        tensors = tuple(tensors)
        if len(tensors) != num_completed + int(has_partial):
            raise ValueError(
                f"depth state after {layers_done} layers needs {num_completed} completed blocks"
                f"{' + a partial block' if has_partial else ''}, got {len(tensors)} tensors"
            )
        partial = tensors[-1] if has_partial else None
        completed = tensors[:-1] if has_partial else tensors
        return DepthState(completed, partial, layers_done, layout)
