"""The pipeline benchmark's tuple payload: each boundary's ``k`` tensors sent one by one.

Training sends a boundary's depth state packed into one ``[k, s, b, h]`` tensor (the
activation contract, DESIGN.md section 3), because DeepSpeed runs one backward traversal and
one p2p message per element of a tuple payload. ``bench/pipeline_bench.py`` measures what
packing buys by running the same model with the payload split into its ``k`` rows: this module
builds that variant here, in the harness, around the product's module. On the sending stage the
packed payload is unbound into a ``k``-tuple of row views (no copy); on the receiving stage the
tuple is stacked back (one copy of the payload, which the packed path does not make) and
unpacked as usual, so the two variants differ in the payload's wire format only.
"""

from __future__ import annotations

import contextlib

import torch

from attnres_dist.pipeline.module import AttnResPipelineModule


class TuplePayloadModule(AttnResPipelineModule):
    """``AttnResPipelineModule`` sending each ``[k, s, b, h]`` payload as a tuple of ``k``
    tensors ``[s, b, h]``. Not for boundaries that carry tokens (Megatron's per-sample
    document options): DeepSpeed sends no nested tuples."""

    def forward(self, forward_input):
        if self.carries_tokens:
            raise ValueError("the tuple payload does not carry tokens: no per-sample documents")
        start, stop = self.stage_layers
        num_layers = self.plan.num_layers
        if 1 <= start <= num_layers + 1:  # receives a depth state: restack its tensors
            if torch.is_tensor(forward_input):  # a one-tensor tuple may arrive as the tensor
                forward_input = forward_input.unsqueeze(0)
            else:
                forward_input = torch.stack(tuple(forward_input))
        out = super().forward(forward_input)
        if stop - 1 <= num_layers:  # the last local part (embedding or a layer) sends a state
            return tuple(out.unbind(0))
        return out


@contextlib.contextmanager
def building(payload: str):
    """While open, the trainer's pipeline engine builds ``TuplePayloadModule`` when
    ``payload`` is ``"tuple"`` (``"packed"``: the product's module, unchanged).

    ``PipelineEngine`` constructs the module itself and takes no payload option (training has
    no use for one), so the class it calls is swapped for the duration of one build.
    """
    if payload not in ("packed", "tuple"):
        raise ValueError(f"payload {payload!r}: expected 'packed' or 'tuple'")
    import attnres_dist.pipeline.engine as engine_mod

    original = engine_mod.AttnResPipelineModule
    if payload == "tuple":
        engine_mod.AttnResPipelineModule = TuplePayloadModule
    try:
        yield
    finally:
        engine_mod.AttnResPipelineModule = original
