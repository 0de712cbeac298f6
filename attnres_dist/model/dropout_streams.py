"""Dropout random streams that are the same in every pipeline and data-parallel layout.

Dropout draws from two generators: the default one (the AttnRes layer's hidden dropout) and
Megatron-Core's RNG tracker (attention dropout under tensor parallelism, whose model-parallel
stream is offset by the tensor rank so that head shards draw different masks; at ``tp = 1``
attention dropout draws from the default generator, ``model/sdpa_attention.py``).
Drawn sequentially, the masks of layer ``l`` would depend on how many draws ran before it on
the same rank: on the stage layout. Megatron accepts that (it offsets its seed by pipeline
rank, so pp = 2 and pp = 1 train different dropout masks).

Here every layer (and the embedding, whose Megatron embedding dropout draws from the default
generator) instead re-seeds both streams, for the duration of its forward, from
``(run seed, optimizer step, global micro-batch index, layer index)`` (the tracker stream also
from the tensor rank, as Megatron does). The masks of layer 7 for micro-batch 3 of step 12 are
then the same on any stage of any pipeline depth and any data-parallel rank, and the
equivalence of layouts holds with dropout on. Only ``tp`` changes the attention-dropout masks
(each tensor rank draws for its own heads).

The trainer calls ``begin_step`` before each optimizer step; the model containers call
``next_micro_batch`` at the start of each training forward (one per micro-batch on every
stage; DeepSpeed's 1F1B schedule runs a stage's forwards in micro-batch order). Schedules that
run a rank's chunks out of micro-batch order (virtual stages) name the micro-batch instead,
with ``use_micro_batch``. With no step
begun (callers outside the trainer), the streams are left alone and draw sequentially.
Recompute restores the key of the forward it replays (``model/recompute.py``).
"""

from __future__ import annotations

import contextlib
import hashlib

import torch

# (seed, step, next micro-batch index) while a step runs; the key of the current micro-batch
_STEP: list | None = None
_KEY: tuple[int, int, int] | None = None
_FIRST = [0]  # the step's first micro-batch index on this rank (use_micro_batch counts from it)
EMBEDDING = -1  # the "layer index" of the embedding's dropout


def begin_step(seed: int, step: int, first_micro_batch: int = 0) -> None:
    """Start optimizer step ``step``; this rank's first micro-batch has global index
    ``first_micro_batch`` (data-parallel rank x micro-batches per rank)."""
    global _STEP, _KEY
    _STEP = [seed, step, first_micro_batch]
    _FIRST[0] = first_micro_batch
    _KEY = None


def end() -> None:
    """Back to sequential streams (no step running)."""
    global _STEP, _KEY
    _STEP, _KEY = None, None


def next_micro_batch() -> None:
    """A training forward of the next micro-batch starts (a no-op when no step was begun)."""
    global _KEY
    if _STEP is not None:
        _KEY = (_STEP[0], _STEP[1], _STEP[2])
        _STEP[2] += 1


def use_micro_batch(index: int) -> None:
    """The next training forward is of this rank's micro-batch ``index`` (0-based within the
    step; a no-op when no step was begun). Unlike ``next_micro_batch`` it does not count."""
    global _KEY
    if _STEP is not None:
        _KEY = (_STEP[0], _STEP[1], _FIRST[0] + index)


def current_key() -> tuple[int, int, int] | None:
    return _KEY


def set_key(key: tuple[int, int, int] | None) -> None:
    global _KEY
    _KEY = key


def derive_seed(*parts) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**63)


def _tracker_state(seed: int):
    """A fresh state of the tracker's kind (CUDA generator state on GPU, CPU one otherwise)."""
    if torch.cuda.is_available():
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            torch.cuda.manual_seed(seed)
            return torch.cuda.get_rng_state()
    return torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def layer_streams(layer_index: int, enabled: bool = True):
    """Run one layer's forward with both dropout streams seeded from its key (module doc)."""
    key = _KEY
    if key is None or not enabled:
        yield
        return
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.get_cuda_rng_tracker()
    name = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME
    tp_rank = (
        parallel_state.get_tensor_model_parallel_rank()
        if parallel_state.model_parallel_is_initialized()
        else 0
    )
    saved = tracker.get_states()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(derive_seed(*key, layer_index, "hidden"))
        states = dict(saved)
        states[name] = _tracker_state(derive_seed(*key, layer_index, "tensor-parallel", tp_rank))
        tracker.set_states(states)
        try:
            yield
        finally:
            tracker.set_states(saved)
