"""One transformer layer with Attention Residuals, around Megatron-Core's local layer.

Megatron builds the layer (``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm``,
``mlp``); this module calls those submodules directly and owns the residual logic instead of
Megatron's bias-dropout-add. Each of the two sublayers reads a depth-attention mix over the
state's sources (its own zero-initialised query and key RMSNorm gain: a row of the layer's
``mixer_weights``), and its raw output is added
to the partial block, which is closed into the completed list where the block plan says so.
Delta AttnRes adds the mix (over the completed blocks only) to the residual stream before the
norm. Baseline mode applies the plain PreNorm residual with the very same submodules.

With a two-phase implementation the mix is phase 1 (at a segment's first sublayer, for the
whole segment) plus phase 2 (``attnres_dist.model.depth_mixing``).

The layer computes itself and nothing else: recompute (activation checkpointing) and compiled
regions are applied from outside, by the runs its chunk's container calls
(``model/layer_runs.py``). ``recompute: attnres`` recomputes the mix and the PreNorm after it
in backward, so nothing of them is stored beyond the sources, which stay alive anyway.
Two-phase: the recomputed region is phase 2 and the norm; phase 1 saves only its inputs, its
outputs and ``[n, tokens, S]`` statistics, so its outputs (one float32 ``[s, b, h]`` per
sublayer, the regions' inputs) are kept instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model import dropout_streams
from attnres_dist.model.depth_mixing import DepthMixer, configure_segments, mixer_weights
from attnres_dist.model.depth_state import DepthState
from attnres_dist.model.sdpa_attention import SdpaAttention
from attnres_dist.model.sequence_context import sequence_context, with_layout

__all__ = ["AttnResLayer", "DepthMixer"]


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
            self.attn_mixer = DepthMixer(self.mixer_weights, 0, impl, delta=plan.delta)
            self.mlp_mixer = DepthMixer(self.mixer_weights, 1, impl, delta=plan.delta)
        self.store_capacity = plan.final_num_sources  # rows of the block store's buffer
        self.segments = {}  # sublayer -> Segment (two-phase schedule)
        configure_segments([self], plan)
        attention = megatron_layer.self_attention
        self._sdpa = isinstance(getattr(attention, "core_attention", None), SdpaAttention)
        # the scale of the rotary tables the context makes for the attention, or None
        self._tables_mscale = attention.mscale if getattr(attention, "takes_tables", 0) else None

    def sublayer_norms(self) -> list:
        """The norm in front of the attention and the one in front of the MLP: the local
        spec's modules, or under Transformer Engine the linears that fuse them (``eps``)."""
        layer = self.layer
        norms = [layer.input_layernorm, layer.pre_mlp_layernorm]
        fused = [lambda: layer.self_attention.linear_qkv, lambda: layer.mlp.linear_fc1]
        return [n if hasattr(n, "eps") else f() for n, f in zip(norms, fused, strict=True)]

    @property
    def first_sublayer(self) -> int:
        return 2 * self.layer_index + 1

    # -- sublayer functions f(x) = Sublayer(Norm(x)); outputs are the raw v_i of the paper --

    def _attention(self, normed, ctx):
        # SDPA runs a plain causal mask as is_causal: passed no mask, it takes its mask type
        mask = None if ctx.causal and self._sdpa else ctx.attention_mask
        rotary = ctx.rotary_pos_emb if ctx.tables is None else ctx.tables
        out, bias = self.layer.self_attention(normed, attention_mask=mask, rotary_pos_emb=rotary)
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

    def context(self, state: DepthState):
        """The sequence context (RoPE tables, mask, layout) of the layers acting on ``state``."""
        if state.layers_done != self.layer_index:
            raise RuntimeError(
                f"layer {self.layer_index} got a depth state after {state.layers_done} layers"
            )
        like, seq_dim = (state.partial, 0) if state.store is None else (state.store, 1)
        config = self.layer.config
        ctx = sequence_context(
            config, like, self.rotary_base, self.rope_scaling_factor, seq_dim, self._tables_mscale
        )
        return with_layout(ctx, state.layout)

    def sublayers(self, state: DepthState, ctx) -> DepthState:
        """The layer's two sublayers on ``state``: the region ``runtime.compile: layer``
        compiles (``model/layer_runs.py``)."""
        first = self.first_sublayer
        state = self._sublayer(state, first, ctx)
        state = self._sublayer(state, first + 1, ctx)
        if state.phase1 is None:
            return state
        return replace(state, phase1=state.phase1.handed_on(first + 2))

    def forward(self, state: DepthState, region=None) -> DepthState:
        """The layer on ``state``; ``region``: its sublayers compiled, or None. A measured
        micro-batch runs eagerly, as the final aggregation's does: its hook is Python that a
        compiled region does not trace, and a region reads nothing that changes between
        training steps (model/compiled_region.py, SteadyGuards)."""
        ctx = self.context(state)
        if region is None or self.probe is not None:
            region = self.sublayers
        with dropout_streams.layer_streams(self.layer_index, self.training and self.uses_dropout):
            state = region(state, ctx)
        return replace(state, layers_done=self.layer_index + 1)
