"""The AttnRes GPT as a DeepSpeed ``PipelineModule`` cut into virtual stages (model chunks).

The layer list is the one of ``AttnResPipelineModule`` (``module.layer_specs``: the same
builder, so the same weights), cut over C = P * V chunks by a ``VirtualLayout`` (looped or
V-shaped placement) instead of over P stages. Each rank builds all of its chunks, one "phase"
each (phase = rank-local chunk index), the way DeepSpeed's ``DualPipeVModule`` builds its two:
``activate_phase`` exposes one chunk's parts as ``forward``. Parts are registered under their
global list index, so parameter names (and checkpoints) do not depend on the layout. The tied
embedding is one module per rank: on the V shape rank 0 holds embedding and head and shares it;
on the looped layout rank 0 and rank P - 1 hold copies that DeepSpeed keeps in sync.

The engine names the pass before each forward (``set_pass``: phase and micro-batch), because a
rank runs its chunks out of micro-batch order: the dropout streams are keyed by that micro-batch
and the chunk-boundary object (``chunk_boundary.py``) is told which (chunk, micro-batch) it
serves. At a chunk's edges the module calls the boundary instead of the contract directly.
Recompute and two-phase segments are configured per chunk (a chunk is a stage of its own).
"""

from __future__ import annotations

import torch
from deepspeed.pipe import PipelineModule

from attnres_dist.model import dropout_streams
from attnres_dist.model.depth_state import DepthState
from attnres_dist.model.gpt import ModelBuilder
from attnres_dist.pipeline.module import SteadyMode, configure_local_layers, pipeline_module_args
from attnres_dist.pipeline.virtual_layout import VirtualLayout


class VirtualPipelineModule(SteadyMode, PipelineModule):
    """All chunks of one pipeline rank; ``activate_phase`` picks the one ``forward`` runs."""

    def __init__(
        self,
        builder: ModelBuilder,
        layout: VirtualLayout,
        topology,
        boundary,
        recompute: str = "none",
        recompute_interval: int = 1,
    ):
        if builder.documents is not None and builder.documents.per_sample:
            raise ValueError("virtual stages do not carry per-sample document tokens")
        self.layout = layout
        self.boundary = boundary
        self.plan = builder.plan
        self.documents = builder.documents
        self.micro_batch = 0
        super().__init__(**pipeline_module_args(builder, topology))
        for funcs in self.phase_funcs:
            configure_local_layers(
                funcs, self.plan, recompute, recompute_interval, builder.compile_options
            )

    # -- layout ----------------------------------------------------------------------------

    def _partition_layers(self, method="fixed"):
        lay = self.layout
        if lay.P != self.num_stages:
            raise ValueError(f"layout has {lay.P} ranks, the topology {self.num_stages}")
        self.num_stages = lay.C  # as DualPipeVModule: the module counts chunks
        self.parts = list(lay.parts)
        self.chunks = lay.chunks_of(self.stage_id)
        self.phase_bounds = [(self.parts[c], self.parts[c + 1]) for c in self.chunks]
        self._set_bounds(*self.phase_bounds[0])

    def stage_owner(self, layer_idx):
        """The pipeline rank that owns list index ``layer_idx`` (DeepSpeed's tied groups)."""
        return self.layout.rank_of(super().stage_owner(layer_idx))

    def _build(self):
        self.phase_funcs = []
        for start, stop in self.phase_bounds:
            self._set_bounds(start, stop)
            super()._build()
            self.phase_funcs.append(self.forward_funcs)
            self.forward_funcs = []
        self.activate_phase(0)

    def activate_phase(self, phase: int) -> None:
        self.active_phase = phase
        self.forward_funcs = self.phase_funcs[phase]
        self._local_start, self._local_stop = self.phase_bounds[phase]

    def set_pass(self, phase: int, micro_batch: int) -> None:
        """The next ``forward`` runs this rank's ``phase`` for ``micro_batch``."""
        self.activate_phase(phase)
        self.micro_batch = micro_batch

    @property
    def chunk(self) -> int:
        return self.chunks[self.active_phase]

    @property
    def stage_layers(self) -> tuple[int, int]:
        """Model-part indices [start, stop) of the active chunk."""
        return self._local_start, self._local_stop

    @property
    def carries_tokens(self) -> bool:
        return False

    def _synchronize_tied_weights(self):
        with torch.no_grad():  # as AttnResPipelineModule: no autograd node for the broadcast
            super()._synchronize_tied_weights()

    def save_state_dict(self, *args, **kwargs):
        for phase in range(len(self.chunks)):
            self.activate_phase(phase)
            super().save_state_dict(*args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        for phase in range(len(self.chunks)):
            self.activate_phase(phase)
            super().load_state_dir(*args, **kwargs)

    # -- forward ---------------------------------------------------------------------------

    def forward(self, forward_input):
        chunk, mb = self.chunk, self.micro_batch
        if self.training:  # the masks of (step, micro-batch, layer), whatever the order
            dropout_streams.use_micro_batch(mb)
        if chunk > 0 and 1 <= self._local_start <= self.plan.num_layers + 1:
            forward_input = self.boundary.receive(chunk, mb, forward_input)
        out = super().forward(forward_input)
        if isinstance(out, DepthState):
            return self.boundary.send(chunk, mb, out)
        return out
