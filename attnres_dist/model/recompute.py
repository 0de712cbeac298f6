"""Activation checkpointing that replays the forward's dropout masks exactly.

``torch.utils.checkpoint`` (non-reentrant) restores the default CPU and CUDA generators before
it recomputes, but not Megatron-Core's RNG tracker, from which attention dropout draws, nor
the layout-independent dropout key (``model/dropout_streams.py``). ``checkpoint`` here adds
both through the ``context_fn`` hook: the forward context records the tracker's states and
the key, the recompute context puts them back for the replay and afterwards restores what
was current, so the streams continue as if nothing had been recomputed.

Megatron's own ``tensor_parallel.checkpoint`` does restore the tracker, but it is a reentrant
autograd Function (inputs detached, a nested ``torch.autograd.backward``, outputs that are
inputs passed through are not supported as such) and reads the CUDA generator
unconditionally, so it neither runs on CPU nor suits the packed DepthState tensors that
full-layer recompute returns (completed blocks pass through a group unchanged).

``checkpoint_deterministic`` is the plain checkpoint for what draws no random numbers (the
depth mix and its norm, ``recompute: attnres``), the same call eager and compiled.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from attnres_dist.model import dropout_streams


def _copy(states: dict) -> dict:
    out = {}
    for name, state in states.items():
        if torch.is_tensor(state):
            out[name] = state.clone()
        elif hasattr(state, "clone_state"):  # a graph-safe CUDA generator
            out[name] = state.clone_state()
        else:
            out[name] = state
    return out


def _tracker():
    from megatron.core.tensor_parallel import random as mp_random

    return mp_random.get_cuda_rng_tracker()


def _rng_contexts():
    """(forward context, recompute context) sharing the states recorded at forward time."""
    recorded = {}

    @contextlib.contextmanager
    def forward():
        recorded["tracker"] = _copy(_tracker().get_states())
        recorded["key"] = dropout_streams.current_key()
        yield

    @contextlib.contextmanager
    def recompute():
        tracker = _tracker()
        current_states, current_key = tracker.get_states(), dropout_streams.current_key()
        tracker.set_states(_copy(recorded["tracker"]))
        dropout_streams.set_key(recorded["key"])
        try:
            yield
        finally:
            tracker.set_states(current_states)
            dropout_streams.set_key(current_key)

    return forward(), recompute()


def checkpoint(function, *args):
    """``function(*args)`` checkpointed (non-reentrant) with every RNG stream replayed: full
    recompute, whose layers draw dropout masks; it wraps whole layers, outside any compiled
    region."""
    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=_rng_contexts)


def checkpoint_deterministic(function, *args):
    """``function(*args)`` checkpointed (non-reentrant) where it draws no random numbers: the
    depth mix and its norm (``recompute: attnres``), eager or inside a compiled layer, where
    Dynamo traces it as a tagged subgraph that the backward graph recomputes. Nothing to
    replay, so no generator state is saved either."""
    return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)
