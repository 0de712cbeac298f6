"""One transformer layer with Attention Residuals, around Megatron-Core's local layer.

Megatron builds the layer (``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm``,
``mlp``); this module calls those submodules directly and owns the residual logic instead of
Megatron's bias-dropout-add. Each of the two sublayers reads a depth-attention mix over the
state's sources (its own zero-initialised query and key RMSNorm gain: a row of the layer's
``mixer_weights``), and its raw output is added
to the partial block, which is closed into the completed list where the block plan says so.
Baseline mode applies the plain PreNorm residual with the very same submodules.

With a two-phase implementation the mix is phase 1 (at a segment's first sublayer, for the
whole segment) plus phase 2 (``attnres_dist.model.depth_mixing``).

Recompute (activation checkpointing, ``model/recompute.py``: dropout masks replayed exactly)
lives here too:
* ``attnres``: the mix and the PreNorm after it are recomputed in backward, so nothing of them
  is stored beyond the sources, which stay alive anyway. Two-phase: the region is phase 2 and
  the norm; phase 1 saves only its inputs, its outputs and ``[n, tokens, S]`` statistics, so its
  outputs (one float32 ``[s, b, h]`` per sublayer, the regions' inputs) are kept instead;
* ``full``: groups of ``interval`` consecutive local layers are recomputed whole. The first
  layer of a group runs the group under one checkpoint; the others see the state's
  ``layers_done`` already past them and pass it through.

Compiled regions (``model/compiled_region.py``): with ``runtime.compile: layer`` each layer's
two sublayers are one region; with ``chunk`` the consecutive local layers of a model chunk
(under full recompute: of a recompute group) are one region, run by the first of them (its
``run``) as a recompute group is: the sequence context is built once for all of them, and one
compiled call, one autograd node and one cache lookup serve the whole run
(``configure_compiled_runs``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model import compiled_region, dropout_streams
from attnres_dist.model.depth_mixing import (
    DepthMixer,
    configure_segments,
    mixer_weights,
)
from attnres_dist.model.depth_state import DepthState
from attnres_dist.model.recompute import checkpoint
from attnres_dist.model.sdpa_attention import SdpaAttention
from attnres_dist.model.sequence_context import sequence_context, with_layout

__all__ = [
    "AttnResLayer",
    "DepthMixer",
    "configure_compiled_runs",
    "configure_recompute",
    "configure_segments",
]


class AttnResLayer(torch.nn.Module):
    """Transformer layer ``layer_index`` (0-based, global) acting on a DepthState."""

    # Measurement hook (attnres_dist.diagnostics): set on a measured micro-batch only, so an
    # unmeasured pass pays one attribute check per sublayer and the graph is never touched.
    probe = None

    def __init__(
        self,
        megatron_layer,
        plan: BlockPlan,
        layer_index: int,
        impl: str = "lean",
        rotary_base: int = 10000,
        rope_scaling_factor: float | None = None,
    ):
        super().__init__()
        self.rotary_base = rotary_base
        self.rope_scaling_factor = rope_scaling_factor  # Llama 3's RoPE scaling; None = off
        self.layer = megatron_layer
        self.plan = plan
        self.layer_index = layer_index
        self.hidden_dropout = megatron_layer.config.hidden_dropout
        self.uses_dropout = self.hidden_dropout > 0 or megatron_layer.config.attention_dropout > 0
        if plan.mode != "baseline":
            # the attention's and the MLP's mixers: rows 0 and 1 of one parameter
            self.mixer_weights = mixer_weights(2, megatron_layer.config.hidden_size)
            self.attn_mixer = DepthMixer(self.mixer_weights, 0, impl)
            self.mlp_mixer = DepthMixer(self.mixer_weights, 1, impl)
        self.recompute = "none"
        self.group: list[AttnResLayer] = [self]  # layers recomputed together (full recompute)
        self.store_capacity = plan.final_num_sources  # rows of the block store's buffer
        self.segments = {}  # sublayer -> Segment (two-phase schedule)
        configure_segments([self], plan)
        core = getattr(megatron_layer.self_attention, "core_attention", None)
        self._sdpa = isinstance(core, SdpaAttention)
        self._region = self.sublayers  # the compiled region (``compile_region``) or itself
        # the layers this one runs as one compiled region (``runtime.compile: chunk``; set by
        # ``configure_compiled_runs``), and the options to compile it with (the builder's)
        self.run: list[AttnResLayer] = [self]
        self._run_region = None
        self.run_compile_options: tuple[str, bool] | None = None

    def compile_region(self, backend: str = "inductor", cuda_graphs: bool = False) -> None:
        """Run :meth:`sublayers` as one compiled region (``model/compiled_region.py``); the
        sequence context and the dropout streams' seeding stay outside, as its inputs."""
        _synchronous_input_grad_reduce(self.layer)
        self._region = compiled_region.compile_region(self.sublayers, backend, cuda_graphs)

    def sublayer_norms(self) -> list:
        """The norm in front of the attention and the one in front of the MLP: the local
        spec's modules, or under Transformer Engine the linears that fuse them (``eps``)."""
        layer = self.layer
        norms = [layer.input_layernorm, layer.pre_mlp_layernorm]
        fused = [layer.self_attention.linear_qkv, layer.mlp.linear_fc1]
        return [n if hasattr(n, "eps") else f for n, f in zip(norms, fused, strict=True)]

    @property
    def first_sublayer(self) -> int:
        return 2 * self.layer_index + 1

    # -- sublayer functions f(x) = Sublayer(Norm(x)); outputs are the raw v_i of the paper --

    def _attention(self, normed, ctx):
        # SDPA runs a plain causal mask as is_causal: passed no mask, it takes its mask type
        mask = None if ctx.causal and self._sdpa else ctx.attention_mask
        out, bias = self.layer.self_attention(
            normed, attention_mask=mask, rotary_pos_emb=ctx.rotary_pos_emb
        )
        return out if bias is None else out + bias

    def _mlp(self, normed, ctx):
        out, bias = self.layer.mlp(normed)
        return out if bias is None else out + bias

    def _sublayer(self, state: DepthState, sublayer: int, ctx) -> DepthState:
        """Sublayer ``sublayer`` as ``hf/modeling_attnres.py:AttnResDecoderLayer.forward``
        states it (``tests/test_layer_reference.py`` holds the two equal): mix the sources,
        norm, sublayer, dropout, then add the output to the partial block or close the block
        with it. Baseline: the norm reads the residual stream, the output is added to it."""
        attention = sublayer % 2 == 1
        norm = self.layer.input_layernorm if attention else self.layer.pre_mlp_layernorm
        if self.plan.mode == "baseline":
            normed = norm(state.partial)
        else:
            mixer = self.attn_mixer if attention else self.mlp_mixer
            state, normed = mixer.mix_norm(state, self.segments.get(sublayer), sublayer, norm)
        fn = self._attention if attention else self._mlp
        out = F.dropout(fn(normed, ctx), p=self.hidden_dropout, training=self.training)
        if self.probe is not None:
            self.probe.sublayer(self, sublayer, state, out)
        return state.add(out, self.plan.closes_block(sublayer), self.store_capacity)

    def _context(self, state: DepthState):
        """The sequence context (RoPE tables, mask, layout) of the layers acting on ``state``."""
        if state.layers_done != self.layer_index:
            raise RuntimeError(
                f"layer {self.layer_index} got a depth state after {state.layers_done} layers"
            )
        like, seq_dim = (state.partial, 0) if state.store is None else (state.store, 1)
        config = self.layer.config
        ctx = sequence_context(config, like, self.rotary_base, self.rope_scaling_factor, seq_dim)
        return with_layout(ctx, state.layout)

    def apply_run(self, state: DepthState) -> DepthState:
        """This layer, or the compiled run of layers it leads (``runtime.compile: chunk``), on
        ``state``. A measured micro-batch runs its layers one by one (``apply_layer``)."""
        if self._run_region is None or any(layer.probe is not None for layer in self.run):
            for layer in self.run:
                state = layer.apply_layer(state)
            return state
        return self._run_region(state, self._context(state))

    def run_layers(self, state: DepthState, ctx) -> DepthState:
        """The sublayers of every layer in ``run`` on ``state``: the region a chunk compiles
        (no dropout: ``runtime.compile: chunk`` refuses it, each layer seeds its own streams)."""
        for layer in self.run:
            state = layer.sublayers(state, ctx)
            state = replace(state, layers_done=layer.layer_index + 1)
        return state

    def apply_layer(self, state: DepthState) -> DepthState:
        ctx = self._context(state)
        # a measured micro-batch runs eagerly, as the final aggregation's does: its hook is
        # Python that a compiled region does not trace, and a region reads nothing that
        # changes between training steps (model/compiled_region.py, SteadyGuards)
        region = self._region if self.probe is None else self.sublayers
        with dropout_streams.layer_streams(self.layer_index, self.training and self.uses_dropout):
            state = region(state, ctx)
        return replace(state, layers_done=self.layer_index + 1)

    def sublayers(self, state: DepthState, ctx) -> DepthState:
        """The layer's two sublayers on ``state``: the region ``compile_region`` compiles."""
        first = self.first_sublayer
        state = self._sublayer(state, first, ctx)
        state = self._sublayer(state, first + 1, ctx)
        if state.phase1 is None:
            return state
        return replace(state, phase1=state.phase1.handed_on(first + 2))

    def forward(self, state: DepthState) -> DepthState:
        if state.layers_done > self.layer_index:
            return state  # applied by the leader of its recompute group or compiled run
        if self.recompute != "full" or not torch.is_grad_enabled():
            return self.apply_run(state)
        group = self.group
        num_completed, has_partial = self.plan.state_after(2 * state.layers_done)

        grown = {}  # the buffer the group's store grew into, for the layers after it

        def run_group(*tensors):
            inner = DepthState.from_parts(
                tensors, num_completed, has_partial, state.layers_done, state.buffer, state.layout
            )
            for layer in group:  # under compile: chunk, the group is its first layer's run
                if inner.layers_done == layer.layer_index:
                    inner = layer.apply_run(inner)
            grown["buffer"] = inner.buffer
            return inner.parts()

        outputs = checkpoint(run_group, *state.parts())
        done = state.layers_done + len(group)
        completed, partial = self.plan.state_after(2 * done)
        return DepthState.from_parts(
            outputs, completed, partial, done, grown.get("buffer"), state.layout
        )


def configure_recompute(layers: list[AttnResLayer], mode: str, interval: int = 1) -> None:
    """Set the recompute mode of consecutive local layers; group them by ``interval`` for full."""
    for start in range(0, len(layers), interval):
        group = layers[start : start + interval]
        for layer in group:
            layer.recompute = mode
            layer.group = group
            if layer.plan.mode != "baseline":
                layer.attn_mixer.recompute = layer.mlp_mixer.recompute = mode == "attnres"


def configure_compiled_runs(layers: list[AttnResLayer]) -> None:
    """Under ``runtime.compile: chunk`` (the builder set ``run_compile_options``), compile the
    consecutive local layers of one chunk as one region, led by the first: each recompute
    group under full recompute (the group is checkpointed around it), else all of them. Call
    after ``configure_recompute``."""
    if not layers or layers[0].run_compile_options is None:
        return
    if any(layer.uses_dropout for layer in layers):  # the config rules refuse it too
        raise ValueError("runtime.compile=chunk: a layer with dropout seeds its own streams")
    backend, cuda_graphs = layers[0].run_compile_options
    runs = [layers] if layers[0].recompute != "full" else _groups(layers)
    for run in runs:
        leader = run[0]
        for layer in run:
            _synchronous_input_grad_reduce(layer.layer)
        leader.run = list(run)
        leader._run_region = compiled_region.compile_region(leader.run_layers, backend, cuda_graphs)


def _groups(layers: list[AttnResLayer]) -> list[list[AttnResLayer]]:
    """The recompute groups of consecutive layers, in order."""
    groups = []
    for layer in layers:
        if not groups or groups[-1] is not layer.group:
            groups.append(layer.group)
    return groups


def _synchronous_input_grad_reduce(layer: torch.nn.Module) -> None:
    """Under tensor parallelism, each column-parallel linear's input gradient all-reduced by
    Megatron's own synchronous path (``copy_to_tensor_model_parallel_region``) instead of the
    asynchronous one inside its matmul's backward: the same sum, but an ``async_op`` handle
    does not trace, and inside a compiled region the compiler orders the collective anyway."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    for module in layer.modules():
        if isinstance(module, ColumnParallelLinear) and module.allreduce_dgrad:
            module.allreduce_dgrad = False
