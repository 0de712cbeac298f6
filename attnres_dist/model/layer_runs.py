"""How one chunk's transformer layers run: recompute and compile, applied from outside them.

As torchtitan's ``apply_ac`` and ``apply_compile`` wrap a model's blocks, ``apply_runs`` takes
the consecutive local layers of one chunk (a stage's, or one virtual chunk's) and returns the
*runs* that the chunk's container calls in their place (``AttnResGPT.hidden_states``,
``pipeline/module.py:LayerPipe``). A layer itself only ever computes itself
(``AttnResLayer.forward``); what is recomputed, and what is one compiled graph, is a run's.

* A run is consecutive layers applied in order. Under ``recompute: full`` each group of
  ``interval`` layers is one run, checkpointed whole with its dropout masks replayed
  (``model/recompute.py``); else each layer is one, or, under ``runtime.compile: chunk``, the
  whole chunk.
* ``recompute: attnres`` recomputes each sublayer's depth mix and its norm in backward: the
  mixers' ``recompute`` (``model/depth_mixing.py``).
* ``runtime.compile: layer``: each layer's sublayers are one compiled region; ``chunk``: each
  run's sublayers, run on one sequence context (``model/compiled_region.py``). A measured
  micro-batch (the diagnostics probe) runs its layers eagerly one by one.

Full-recompute groups also cut the two-phase segments (``configure_segments``): a recomputed
group starts from its input state, without the phase-1 results of the group before it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model import compiled_region
from attnres_dist.model.attnres_layer import AttnResLayer
from attnres_dist.model.depth_mixing import configure_segments
from attnres_dist.model.depth_state import DepthState
from attnres_dist.model.recompute import checkpoint


@dataclass(frozen=True)
class CompileOptions:
    """What ``runtime.compile`` asks of the layers (``ModelBuilder.compile_options``)."""

    backend: str = "inductor"
    cuda_graphs: bool = False
    chunked: bool = False  # ``chunk``: a run's layers are one region; else each layer is


class LayerRun:
    """Consecutive local layers applied as one unit (module docstring)."""

    def __init__(self, layers: list[AttnResLayer], plan: BlockPlan, checkpointed: bool = False):
        self.layers = layers
        self.plan = plan
        self.checkpointed = checkpointed
        self.layer_regions: list = [None] * len(layers)  # compile: layer
        self.region = None  # compile: chunk: every layer's sublayers as one region

    def __call__(self, state: DepthState) -> DepthState:
        if not self.checkpointed or not torch.is_grad_enabled():
            return self.apply(state)
        first = state.layers_done
        completed, partial = self.plan.state_after(2 * first)
        grown = {}  # the buffer the run's store grew into, for the layers after it

        def run(*tensors):
            inner = DepthState.from_parts(
                tensors, completed, partial, first, state.buffer, state.layout
            )
            inner = self.apply(inner)
            grown["buffer"] = inner.buffer
            return inner.parts()

        outputs = checkpoint(run, *state.parts())
        done = first + len(self.layers)
        completed_after, partial_after = self.plan.state_after(2 * done)
        return DepthState.from_parts(
            outputs, completed_after, partial_after, done, grown.get("buffer"), state.layout
        )

    def apply(self, state: DepthState) -> DepthState:
        """The layers on ``state``, without recompute."""
        if self.region is None or any(layer.probe is not None for layer in self.layers):
            for layer, region in zip(self.layers, self.layer_regions, strict=True):
                state = layer(state, region)
            return state
        state = self.region(state, self.layers[0].context(state))
        return replace(state, layers_done=self.layers[-1].layer_index + 1)

    def sublayers(self, state: DepthState, ctx) -> DepthState:
        """Every layer's sublayers on ``state``: the region ``chunk`` compiles (no dropout:
        ``runtime.compile: chunk`` refuses it, each layer seeds its own streams)."""
        for layer in self.layers:
            state = layer.sublayers(state, ctx)
            state = replace(state, layers_done=layer.layer_index + 1)
        return state


def apply_runs(
    layers: list[AttnResLayer],
    plan: BlockPlan,
    recompute: str = "none",
    interval: int = 1,
    compile: CompileOptions | None = None,
    final=None,
) -> list[LayerRun]:
    """The runs of one chunk's consecutive local ``layers`` (module docstring); ``final``: the
    ``FinalAggregation`` that runs right after them, if any (it may join their last two-phase
    segment)."""
    full = recompute == "full"
    for layer in layers:
        if plan.mode != "baseline":
            layer.attn_mixer.recompute = layer.mlp_mixer.recompute = recompute == "attnres"
    if full:
        groups = [layers[i : i + interval] for i in range(0, len(layers), interval)]
    elif compile is not None and compile.chunked:
        groups = [layers] if layers else []
    else:
        groups = [[layer] for layer in layers]
    configure_segments(layers, plan, final, groups if full else None)
    runs = [LayerRun(group, plan, checkpointed=full) for group in groups]
    if compile is not None:
        for run in runs:
            _compile(run, compile)
    return runs


def _compile(run: LayerRun, options: CompileOptions) -> None:
    """``run``'s layers as compiled regions: one per layer, or (``chunk``) one for them all."""
    if options.chunked and any(layer.uses_dropout for layer in run.layers):
        raise ValueError("runtime.compile=chunk: a layer with dropout seeds its own streams")
    for layer in run.layers:
        _synchronous_input_grad_reduce(layer.layer)
    args = options.backend, options.cuda_graphs
    if options.chunked:
        run.region = compiled_region.compile_region(
            compiled_region.state_region(run.sublayers), *args
        )
    else:
        run.layer_regions = [
            compiled_region.compile_region(compiled_region.state_region(layer.sublayers), *args)
            for layer in run.layers
        ]


def _synchronous_input_grad_reduce(layer: torch.nn.Module) -> None:
    """Under tensor parallelism, each column-parallel linear's input gradient all-reduced by
    Megatron's own synchronous path (``copy_to_tensor_model_parallel_region``) instead of the
    asynchronous one inside its matmul's backward: the same sum, but an ``async_op`` handle
    does not trace, and inside a compiled region the compiler orders the collective anyway."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for module in layer.modules():
        if isinstance(module, ColumnParallelLinear) and module.allreduce_dgrad:
            module.allreduce_dgrad = False
