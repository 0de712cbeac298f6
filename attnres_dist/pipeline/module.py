"""The AttnRes GPT as a DeepSpeed ``PipelineModule``.

The layer list is the single-process model's parts in order, each built by the same
``ModelBuilder`` (so with the same weights):
``[embedding, layer_0 .. layer_{n-1}, final aggregation, lm head]``. DeepSpeed names parameters
by list index, so checkpoint keys are global and do not depend on the stage count. With tied
embeddings the head is a ``TiedLayerSpec`` of the embedding; DeepSpeed keeps the two copies in
sync and sums their gradients.

Inside a stage, parts pass a ``DepthState``; at the stage's edges this module applies the
activation contract: it unpacks the received ``[k, s, b, h]`` payload (checked against the
block plan) before the first local part, and packs the state after the last one.

With Megatron's per-sample document options (``reset_position_ids`` / ``reset_attention_mask``)
a boundary carries ``(packed, tokens)``: the ``[b, s]`` input ids travel with the activations
(DeepSpeed sends integer tensors without gradients) and each stage rebuilds the positions and
the mask from them (``model/document_masks.py``). The loss mask reaches the last stage with the
labels, as ``(labels, loss_mask)``.
"""

from __future__ import annotations

import dataclasses

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from attnres_dist.model import dropout_streams
from attnres_dist.model.depth_state import DepthState
from attnres_dist.model.document_masks import document_layout
from attnres_dist.model.embedding_head import lm_loss
from attnres_dist.model.gpt import ModelBuilder
from attnres_dist.model.layer_runs import CompileOptions, LayerRun, apply_runs
from attnres_dist.pipeline.contract import pack, unpack


class EmbeddingPipe(torch.nn.Module):
    def __init__(self, builder: ModelBuilder):
        super().__init__()
        self.embedding = builder.embedding()

    def forward(self, tokens):
        return self.embedding(tokens)


def _tied_head(module: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    return module.embedding.logits(hidden)


class LayerPipe(torch.nn.Module):
    """One transformer layer in the pipeline's list; ``run``: the run it leads (recompute,
    compile: ``model/layer_runs.py``), or None where an earlier layer's run applies it."""

    def __init__(self, builder: ModelBuilder, index: int):
        super().__init__()
        self.block = builder.layer(index)
        self.run: LayerRun | None = LayerRun([self.block], builder.plan)

    def forward(self, state: DepthState) -> DepthState:
        if self.run is None:  # applied by its run's first layer
            if state.layers_done <= self.block.layer_index:
                raise RuntimeError(f"layer {self.block.layer_index} was not applied by its run")
            return state
        return self.run(state)


class FinalPipe(torch.nn.Module):
    def __init__(self, builder: ModelBuilder):
        super().__init__()
        self.final = builder.final()

    def forward(self, state: DepthState) -> torch.Tensor:
        return self.final(state)


class OutputPipe(torch.nn.Module):
    def __init__(self, builder: ModelBuilder):
        super().__init__()
        self.output = builder.output()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)


def _loss_fn(logits: torch.Tensor, labels) -> torch.Tensor:
    if isinstance(labels, tuple | list):  # (labels, loss_mask)
        return lm_loss(logits, labels[0], labels[1])
    return lm_loss(logits, labels)


def layer_specs(builder: ModelBuilder) -> list:
    n = builder.model.num_layers
    if builder.model.tie_embeddings:
        embed = TiedLayerSpec(
            "embed", EmbeddingPipe, builder, tied_weight_attr=["embedding.word_embeddings.weight"]
        )
        head = TiedLayerSpec(
            "embed",
            EmbeddingPipe,
            builder,
            forward_fn=_tied_head,
            tied_weight_attr=["embedding.word_embeddings.weight"],
        )
    else:
        embed, head = LayerSpec(EmbeddingPipe, builder), LayerSpec(OutputPipe, builder)
    return [
        embed,
        *(LayerSpec(LayerPipe, builder, i) for i in range(n)),
        LayerSpec(FinalPipe, builder),
        head,
    ]


def pipeline_module_args(builder: ModelBuilder, topology) -> dict:
    """``PipelineModule``'s arguments for ``builder``'s layer list, cut where the subclass's
    ``_partition_layers`` says."""
    return dict(
        layers=layer_specs(builder),
        topology=topology,
        loss_fn=_loss_fn,
        partition_method="fixed",
        activation_checkpoint_interval=0,  # recompute is done by the layers themselves
    )


def configure_local_layers(
    funcs, plan, recompute: str, recompute_interval: int, compile: CompileOptions | None
) -> None:
    """The runs (recompute, two-phase segments, compiled regions: ``model/layer_runs.py``) of
    the transformer layers among one stage's parts (one chunk's), each given to the
    ``LayerPipe`` of its first layer."""
    pipes = [f for f in funcs if isinstance(f, LayerPipe)]
    finals = [f.final for f in funcs if isinstance(f, FinalPipe)]
    layers = [pipe.block for pipe in pipes]
    runs = apply_runs(
        layers, plan, recompute, recompute_interval, compile, finals[0] if finals else None
    )
    leads = {id(run.layers[0]): run for run in runs}
    for pipe in pipes:
        pipe.run = leads.get(id(pipe.block))


class SteadyMode:
    """Module mixin: ``train(mode)`` sets the mode only where a submodule is not in it yet.
    DeepSpeed's ``train_batch`` and ``eval_batch`` call ``train()`` / ``eval()`` every step;
    torch's walks every submodule through ``nn.Module.__setattr__``, a host cost per step
    that reading each submodule's mode mostly avoids. The submodules are listed once, at the
    first call (the tree is fixed once the engine is built): walking the tree with
    ``modules()`` took 0.7 ms a step at 12 layers on the CPU proxy (``bench/host_bench.py``)."""

    _submodules: list | None = None

    def train(self, mode: bool = True):
        if self._submodules is None:
            self._submodules = list(self.modules())
        if all(m.training == mode for m in self._submodules):
            return self
        return super().train(mode)


class AttnResPipelineModule(SteadyMode, PipelineModule):
    """PipelineModule with precomputed ``parts`` and the activation contract at stage edges."""

    def __init__(
        self,
        builder: ModelBuilder,
        parts: list[int],
        topology,
        recompute: str = "none",
        recompute_interval: int = 1,
    ):
        self._fixed_parts = list(parts)
        self.plan = builder.plan
        self.documents = builder.documents
        super().__init__(**pipeline_module_args(builder, topology))
        configure_local_layers(
            self.forward_funcs, self.plan, recompute, recompute_interval, builder.compile_options
        )

    def _partition_layers(self, method="fixed"):
        if len(self._fixed_parts) != self.num_stages + 1:
            raise ValueError(
                f"partition {self._fixed_parts} does not have {self.num_stages} stages"
            )
        self.parts = self._fixed_parts
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def _synchronize_tied_weights(self):
        # DeepSpeed broadcasts the tied parameters in place; outside no_grad that records an
        # autograd node for c10d::broadcast_ on a leaf (torch warns it may backprop through it).
        with torch.no_grad():
            super()._synchronize_tied_weights()

    @property
    def stage_layers(self) -> tuple[int, int]:
        """Model-part indices [start, stop) owned by this stage."""
        return self._local_start, self._local_stop

    @property
    def carries_tokens(self) -> bool:
        return self.documents is not None and self.documents.per_sample

    def forward(self, forward_input):
        if self.training:  # one training forward per micro-batch, in order (dropout streams)
            dropout_streams.next_micro_batch()
        start = self._local_start
        if 1 <= start <= self.plan.num_layers + 1:  # this stage starts with a layer or final
            layers_done = start - 1
            boundary = f"boundary into stage {self.stage_id} (after {layers_done} layers)"
            tokens = None
            if self.carries_tokens:
                forward_input, tokens = forward_input
            forward_input = unpack(
                forward_input, self.plan, layers_done, boundary, self._store_capacity()
            )
            if tokens is not None:
                layout = document_layout(tokens, self.documents)
                forward_input = dataclasses.replace(forward_input, layout=layout)
        out = super().forward(forward_input)
        if not isinstance(out, DepthState):
            return out
        sent = pack(out)
        if self.carries_tokens:
            return (sent, out.layout.tokens)
        return sent

    def _store_capacity(self) -> int | None:
        """The rows this stage's layers grow the store to (None: the stage has no layer)."""
        first = self.forward_funcs[0] if self.forward_funcs else None
        return first.block.store_capacity if isinstance(first, LayerPipe) else None
