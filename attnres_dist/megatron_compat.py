"""Run Megatron-Core's local layers on a machine without CUDA.

Megatron-Core 0.16 builds and runs its local (non-Transformer-Engine) layer spec on CPU, except
for a few CUDA-only calls (DESIGN.md section 4). This module replaces exactly those, when CUDA
is absent or when a process that sees a GPU runs its model on the CPU (``apply(force_cpu=True)``,
e.g. ``generate --device cpu``: Megatron would otherwise take its scratch buffers from the GPU);
otherwise, on a GPU machine, ``apply()`` changes nothing.

* ``torch.cuda.current_device()`` is asked for the device of scratch buffers (attention's
  global memory buffer, RoPE, tensor-parallel mappings): answered with the CPU device.
* ``torch.cuda.synchronize()`` becomes a no-op.
* The CUDA RNG tracker (dropout forks inside attention and tensor-parallel layers) is replaced
  by one that forks the CPU generator, with the same add/fork/get_states/set_states contract.

* MoE's all-to-all token dispatcher copies its split sizes to the host on a CUDA side stream
  and waits on an event: on the CPU they already are on the host, so the stream is one whose
  work is done when it returns, and the sizes become the numpy arrays the GPU path makes.

The causal mask is always passed explicitly by the model, so Megatron's ``device="cuda"`` default
mask is never built.

On every device:

* Megatron-Core 0.16's MoE router reads ``te_general_gemm`` when Transformer Engine's import
  failed, a name it then never defined; it is defined as None (TE absent).
* the router logs its balancing losses from every forward, so a forward recomputed in
  backward (non-reentrant activation checkpointing) logged them twice; its logging skips a
  forward that runs inside backward (the losses' gradients are unchanged).
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = False
_FORCED_CPU = False  # CPU replacements installed although CUDA is visible


def cuda_available() -> bool:
    """CUDA is visible and Megatron's layers may use it (not forced onto the CPU)."""
    return torch.cuda.is_available() and not _FORCED_CPU


def apply(force_cpu: bool = False) -> None:
    """Install the CPU replacements (idempotent; without ``force_cpu`` a no-op when CUDA is
    available). ``force_cpu`` is for a whole process: it cannot be undone."""
    global _APPLIED, _FORCED_CPU
    _define_missing_te_gemm()
    if _APPLIED or (cuda_available() and not force_cpu):
        return
    _FORCED_CPU = torch.cuda.is_available()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    _install_cpu_rng_tracker()
    _install_host_dispatch()
    _APPLIED = True


def _define_missing_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils, router

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if getattr(router.save_to_aux_losses_tracker, "once", False):
        return
    track = moe_utils.save_to_aux_losses_tracker

    def track_forward_once(*args, **kwargs) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            track(*args, **kwargs)

    track_forward_once.once = True
    router.save_to_aux_losses_tracker = track_forward_once


class _HostStream:
    """The CPU's one stream: what is queued on it is done when the call returns."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass


def _install_host_dispatch() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    host = _HostStream()
    torch.cuda.current_stream = lambda device=None: host
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = host
    to_host = moe_utils.maybe_move_tensor_to_cpu

    def host_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()  # the GPU path's type: split sizes for all_to_all_single
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = host_sizes


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """CudaRNGStatesTracker's contract on the CPU generator."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_model_parallel_rng(seed: int) -> None:
    """Megatron's ``model_parallel_cuda_manual_seed`` on GPU; the CPU tracker's equivalent here.

    Tensor-parallel ranks get distinct dropout streams and identical streams elsewhere, as in
    Megatron.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if cuda_available():
        mp_random.model_parallel_cuda_manual_seed(seed)
        return
    apply()
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1 + 2718 + 100 * tp_rank)
