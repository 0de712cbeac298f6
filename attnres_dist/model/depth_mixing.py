"""Depth mixing in the model: the mixers, and the two-phase schedule over segments.

``DepthMixer`` is one sublayer's softmax attention over depth (its zero-initialised
pseudo-query and its key RMSNorm gain) run by the configured implementation. The queries and
gains of a layer's two mixers are one parameter (``mixer_weights``).

Sublayers are grouped into *segments*: consecutive sublayers of one stage that attend over
the same completed blocks. At a segment's first sublayer, phase 1 attends the queries of all
its sublayers over the store in one batched pass; each sublayer then merges what is not in
that store (phase 2). Segments:

* Block AttnRes: a block, cut where a stage or a full-recompute group starts inside it; phase 2
  merges the partial block.
* Full AttnRes (and block size 1, which is the same model): groups of ``FULL_GROUP``
  consecutive sublayers (aligned to multiples of it, cut the same way); phase 2 merges the
  group's own earlier outputs, which are the store's last rows.

Wherever a segment starts, its phase 1 reads the blocks completed when its block (or group)
began, and phase 2 merges the rest: a stage or recompute cut changes which queries are batched
together, not what any sublayer computes. Per sublayer this reads the
  ``c`` earlier sources once per group plus on average ``(G - 1) / 2`` group sources, so
  ``G ~ sqrt(2 c)`` balances the two; 8 suits the depths run here (c up to ~64).

The final aggregation (``FinalAggregation``) runs right after the last layer: its query joins
that layer's segment (``join_final_segment``), so its phase 1 is the segment's and its phase 2
merges the block closed since; a phase 1 of its own would read every block once more.

The phase-1 results live in the state (``Phase1Cache``) until the segment ends; they never
cross a stage boundary. A one-pass implementation (``lean``, ``reference``, ``fla``: phase 2
alone) runs the same schedule with an empty phase 1: a segment per sublayer that reads no
block (``rows`` 0), whose phase 2 reads every source (the store in place, and the partial
block).

Delta AttnRes (``delta``) runs the same schedule without the partial block among the mixed
sources, and adds the residual stream to the mix before the norm: phase 1 also sums the rows
it read (the stream's share of them, once per segment), and each sublayer adds what came after
them (Full: the group's outputs; Block: the partial block). The fused norms are off there: the
norm reads the sum, not the mix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model.depth_state import DepthState, Phase1Cache
from attnres_dist.model.recompute import checkpoint_deterministic
from attnres_dist.ops import get_depth_attention
from attnres_dist.ops.cpu_rms_norm import CpuRMSNorm

FULL_GROUP = 8  # phase-1 batch of Full AttnRes (sublayers)


def mixer_weights(sublayers: int, hidden_size: int) -> torch.nn.Parameter:
    """The packed parameter of ``sublayers`` depth mixers: ``[sublayers, 2, D]``, row ``i``
    holding mixer ``i``'s pseudo-query (zero at init) and its key RMSNorm gain (one at init).
    One tensor per layer rather than four: every parameter costs the host a gradient
    accumulation and a slot in the optimizer's lists each step, whatever its size. No weight
    decay, as for the norms' gains (``no_weight_decay``)."""
    init = torch.stack((torch.zeros(hidden_size), torch.ones(hidden_size)))
    weights = torch.nn.Parameter(init.expand(sublayers, 2, hidden_size).clone())
    weights.no_weight_decay = True
    return weights


class DepthMixer:
    """Softmax attention over depth with a learned pseudo-query (zero at init) and key gain:
    row ``row`` of a packed ``mixer_weights`` parameter that the layer (or the final
    aggregation) owns, run by the configured backend (``attnres_dist.ops``)."""

    def __init__(
        self,
        weights: torch.nn.Parameter,
        row: int,
        impl: str = "lean",
        eps=1e-6,
        delta: bool = False,
    ):
        self.weights = weights
        self.row = row
        self.eps = eps
        self.impl = impl
        self.delta = delta  # Delta AttnRes: the mix of the completed blocks, added to the stream
        self._op = get_depth_attention(impl)
        self.recompute = False  # the mix and its norm recomputed in backward (``attnres``)

    @property
    def query(self) -> torch.Tensor:
        return self.weights[self.row, 0]

    @property
    def key_norm_weight(self) -> torch.Tensor:
        return self.weights[self.row, 1]

    @property
    def two_phase(self) -> bool:
        return self._op.two_phase

    @property
    def grad_into(self) -> bool:
        """Whether the backend's phases add their inputs' gradient into given rows."""
        return "grad_into" in self._op.options

    def __call__(self, sources, return_weights: bool = False):
        q, g = self.weights[self.row].unbind(0)  # one view: one backward node for the two
        return self._op(q, sources, g, eps=self.eps, return_weights=return_weights)

    def mix_norm(self, state: DepthState, segment, sublayer: int, norm):
        """(state, ``norm(mix)``): the sublayer's normalised input (Delta: ``norm(stream +
        mix)``): phase 1 at the segment's first sublayer (its results join the state), then
        this sublayer's merge. Under ``recompute`` (``attnres``) the merge and the norm are
        recomputed in backward."""
        state = segment.begin(state)
        cache = state.phase1
        if self.delta:
            out1, lse, extra, _ = state.merge_inputs(sublayer, with_partial=False)
            inputs = (out1, lse, extra, state.store.dtype, cache.stream, state.partial)
            fn = lambda *a: self.delta_merge(*a, norm=norm)  # noqa: E731
        else:
            out1, lse, extra, into = state.merge_inputs(sublayer, self.grad_into)
            if cache.first_normed and sublayer == cache.first:
                return state, out1  # phase 1 applied this sublayer's norm
            inputs = (out1, lse, extra, state.store.dtype, into)
            fn = lambda *a: self.merge(*a, norm=norm)  # noqa: E731
        if self.recompute and torch.is_grad_enabled():
            return state, checkpoint_deterministic(fn, *inputs)
        return state, fn(*inputs)

    def merge(self, out1, lse, extra, dtype: torch.dtype, into=None, norm=None):
        """Phase 2: this mixer's phase-1 result (None: the empty phase 1 of a one-pass
        backend) merged with ``extra`` (None: nothing), then
        ``norm`` (a module, or None), fused into the merge where the backend fuses an RMSNorm
        and ``norm`` is one (``CpuRMSNorm``); ``into``: where the backend adds the extras'
        gradient (``grad_into``), or None."""
        if extra is None:
            out = out1.to(dtype)
            return out if norm is None else norm(out)
        options = {} if into is None else {"grad_into": into}
        fused = "norm" in self._op.options and isinstance(norm, CpuRMSNorm)
        if fused:
            options["norm"] = (norm.weight, norm.eps)
        out = self._op.phase2(out1, lse, extra, self.weights[self.row], self.eps, **options)
        return out if norm is None or fused else norm(out)

    def delta_merge(self, out1, lse, extra, dtype, stream, partial, norm):
        """Delta AttnRes' phase 2: the mix of the completed blocks (``merge``) added to the
        residual stream, ``stream`` (the rows phase 1 read, summed; None: none) plus ``extra``
        (the rows after them; a tensor or its pieces) plus ``partial``, then ``norm``."""
        for piece in (extra,) if isinstance(extra, torch.Tensor) else extra or ():
            stream = piece.sum(0) if stream is None else stream + piece.sum(0)
        if partial is not None:
            stream = stream + partial
        return norm(self.merge(out1, lse, extra, dtype) + stream)

    def attend_store(self, state: DepthState) -> torch.Tensor:
        """The whole mix for this mixer alone (the final aggregation). Its phase 1 reads
        every row of the store, usually the first to backpropagate into them: it writes their
        gradient into the store's buffer, where autograd would hand the function that made
        the store a gradient of the whole store to copy there. A one-pass backend reads every
        source in phase 2."""
        store = state.store
        extra = None if state.partial is None else state.partial.unsqueeze(0)
        if not self.two_phase:
            pieces = (store,) if extra is None else (store, extra)
            return self.merge(None, None, pieces, store.dtype)
        options = state.store_grad_into(store.shape[0]) if self.grad_into else {}
        weights = self.weights[self.row : self.row + 1]
        out1, lse = self._op.phase1(store, weights, self.eps, **options)
        return self.merge(out1[0], lse[0], extra, store.dtype)


def _stream_base(previous: Phase1Cache | None, store: torch.Tensor) -> torch.Tensor:
    """The sum of ``store``'s rows (Delta's stream, less what came after them): the previous
    segment's sum plus the rows closed since, where the state still holds them (the segment
    before ran on this stage, and no row came with the state at a cut since), else the rows
    summed afresh. Each segment then adds a row or a group's rows, not the whole store, and
    its backward hands each row its gradient alone, not a gradient of the whole store."""
    if (
        previous is None
        or previous.stream is None
        or previous.rows + len(previous.closed) != store.shape[0]
    ):
        return store.sum(0)
    return sum(previous.closed, previous.stream)


def _stacked_weights(mixers: list[DepthMixer]) -> torch.Tensor:
    """The ``[S, 2, D]`` weights of ``mixers``: a slice of one packed parameter where they are
    its consecutive rows (a layer's two mixers), else the slices of each joined."""
    runs = []  # [weights, first row, rows]
    for m in mixers:
        run = runs[-1] if runs else None
        if run is not None and run[0] is m.weights and run[1] + run[2] == m.row:
            run[2] += 1
        else:
            runs.append([m.weights, m.row, 1])
    parts = [w if k == w.shape[0] else w[r : r + k] for w, r, k in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class Segment:
    """Consecutive local sublayers ``first ..`` whose queries phase 1 runs together."""

    first: int
    mixers: list[DepthMixer]
    # completed blocks at the start of the block (Full: group) it belongs to; 0 for a one-pass
    # backend, whose phase 2 reads every source
    rows: int
    # the first sublayer's RMSNorm where phase 1 may apply it too (``fuses_first_norm``)
    first_norm: CpuRMSNorm | None = None

    def fuses_first_norm(self, state: DepthState) -> bool:
        """Whether phase 1 hands the first sublayer its normalised input: it merges nothing
        (the block, or Full group, starts here: nothing closed since ``rows`` and no partial
        block), and the kernel takes float32 blocks (``first_norm`` is set only where the
        norm is the C kernel's and the backend fuses it: ``first_norm``)."""
        return (
            self.first_norm is not None
            and state.partial is None
            and state.num_completed == self.rows
            and state.store.dtype == torch.float32
        )

    def begin(self, state: DepthState) -> DepthState:
        """The state with this segment's phase-1 results (computed at its first sublayer)."""
        cache = state.phase1
        if cache is not None and cache.first == self.first:
            return state
        if self.rows == 0:  # a one-pass backend: the empty phase 1, every source an extra
            empty = (None,) * len(self.mixers)
            return replace(state, phase1=Phase1Cache(self.first, 0, empty, empty))
        op, eps = self.mixers[0]._op, self.mixers[0].eps
        # phase 1 reads the blocks completed when the block (or Full group) began, wherever
        # the segment starts: a stage or recompute cut then changes no arithmetic
        store = state.store
        if store.shape[0] != self.rows:  # a cut inside a Full group (slicing has a cost)
            store = store[: self.rows]
        options = state.store_grad_into(store.shape[0]) if "grad_into" in op.options else {}
        normed = self.fuses_first_norm(state)
        if normed:
            options["first_norm"] = (self.first_norm.weight, self.first_norm.eps)
        out1, lse = op.phase1(store, _stacked_weights(self.mixers), eps, **options)
        stream = _stream_base(cache, store) if self.mixers[0].delta else None
        cache = Phase1Cache(
            self.first, self.rows, tuple(out1), tuple(lse), first_normed=normed, stream=stream
        )
        state = replace(state, phase1=cache)
        # in a compiled region, a checkpointed merge that reads an unbound piece of phase 1's
        # product is a graph AOTAutograd cannot partition (docs/compile.md)
        return state.with_contiguous_phase1() if state.functional else state


def configure_segments(layers: list, plan: BlockPlan, final=None, groups=None) -> None:
    """Give consecutive local layers their segments and the store capacity of their range;
    ``final``: the ``FinalAggregation`` that runs right after them, if any (see
    :func:`join_final_segment`); ``groups``: the full-recompute groups of ``layers`` (None:
    none), which cut segments (a recomputed group starts from its input state, without the
    phase-1 results of the group before it). Call after the mixers' ``recompute`` is set.
    """
    if final is not None:
        final.segment = None
    if not layers or plan.mode == "baseline":
        return
    group_of = {id(layer): id(g) for g in groups or () for layer in g}
    size = plan.effective_block_size
    two_phase = layers[0].attn_mixer.two_phase
    # a one-pass backend reads every source in phase 2 (none in phase 1): a segment per
    # sublayer, whose phase 2 then reads the store in place, not rows stacked since
    group = (FULL_GROUP if size == 1 else size) if two_phase else 1
    capacity = plan.boundary_width(layers[-1].layer_index + 1)
    segments: dict[tuple, Segment] = {}
    for layer in layers:
        layer.store_capacity = capacity
        recompute_group = group_of.get(id(layer))
        layer.segments = {}
        for sublayer, mixer in (
            (layer.first_sublayer, layer.attn_mixer),
            (layer.first_sublayer + 1, layer.mlp_mixer),
        ):
            start = (sublayer - 1) // group * group + 1  # the block's (group's) first sublayer
            key = (recompute_group, start)
            rows = plan.state_after(start - 1)[0] if two_phase else 0
            segment = segments.get(key)
            if segment is None:  # the segment's first local sublayer
                norms = layer.layer.input_layernorm, layer.layer.pre_mlp_layernorm
                norm = norms[0] if sublayer % 2 else norms[1]
                # under attnres recompute the norm belongs to the recomputed region
                fusable = (
                    isinstance(norm, CpuRMSNorm)
                    and not mixer.recompute
                    and not mixer.delta  # Delta's norm reads the stream plus the mix
                    and "first_norm" in mixer._op.options
                )
                segment = segments[key] = Segment(sublayer, [], rows, norm if fusable else None)
            segment.mixers.append(mixer)
            layer.segments[sublayer] = segment
    if final is not None and not group_of:
        join_final_segment(layers[-1], plan, final)


def join_final_segment(last, plan: BlockPlan, final) -> None:
    """The final aggregation's query joins the phase 1 of the last layer's segment: it attends
    over the blocks that segment's phase 1 reads anyway and merges what closed after them
    (phase 2), where a phase 1 of its own would read every block once more, forward and
    backward. Only where the final aggregation runs right after the model's last layer on its
    state (not after a recomputed group, whose output state carries no phase-1 results), with
    the same two-phase implementation; ``final.segment`` is None otherwise."""
    mixer = getattr(final, "mixer", None)
    segment = last.segments.get(last.first_sublayer + 1)
    if (
        mixer is None
        or segment is None
        or last.layer_index != plan.num_layers - 1
        or (mixer.impl, mixer.eps) != (segment.mixers[0].impl, segment.mixers[0].eps)
    ):
        return
    segment.mixers.append(mixer)
    final.segment = segment
