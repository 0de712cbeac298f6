"""DeepSpeed's pipeline engine over virtual stages: DualPipeV's engine, generalised by a layout.

``VirtualPipeEngine`` runs a ``VirtualPipelineModule`` the way DeepSpeed's ``DualPipeVEngine``
runs its two stages per rank, for any ``VirtualLayout`` (V-shaped or looped):

* phases: instructions carry ``phase`` (the rank-local chunk); the pipe buffer of (phase,
  micro-batch) is ``phase * M + micro_batch``; before a pass the module is told its phase and
  micro-batch (``set_pass``). The up- and downstream rank of a phase is the rank of the chunk
  before and after it. Sends and receives are queued and launched by ``CommitP2P``.
* first and loss stage: rank 0 loads the inputs for chunk 0; the rank of chunk C - 1 loads the
  labels into that chunk's buffer and computes the loss there (rank 0's phase 1 on the V, rank
  P - 1's phase V - 1 on the loop).
* the turn: a chunk whose successor is on the same rank (the V's tip on rank P - 1) hands its
  output over as the successor's detached input, and the successor's input gradient back.
* static shapes: each phase's receive is allocated from the cache plan's per-phase shapes
  (``CachePlan.phase_shapes``; the naive or cached payload, as the boundary says), never from
  a shape handshake, so payloads may differ per transition.
* the boundary: a backward pass back-propagates the chunk's outputs together with the
  boundary's ``backward_extras`` and then calls ``after_backward``; the optimizer step and the
  end of an evaluation call ``check_empty``.
* tied embedding: DeepSpeed's ``ReduceTiedGrads`` sums the two copies' gradients on the loop
  (rank 0 and rank P - 1); on the V rank 0 holds one module for both ends.

Schedules: the V shape runs DeepSpeed's ``DualPipeVSchedule``, the loop ``InterleavedSchedule``
(Megatron-Core's order); evaluation their forward-only forms (``SequentialForward`` on the V
when there are fewer than 2P micro-batches, which DualPipeV cannot schedule).
"""

from __future__ import annotations

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.dualpipev import _INIT, DualPipeVEngine, _as_list
from deepspeed.runtime.pipe.engine import PipelineEngine

from attnres_dist.pipeline.contract import PayloadError
from attnres_dist.pipeline.forward_schedule import SequentialForward
from attnres_dist.pipeline.interleaved_schedule import InterleavedSchedule


class VirtualPipeEngine(PipelineEngine):
    """Runs a ``VirtualPipelineModule`` (module docstring)."""

    # DualPipeV's phase-generic parts, as they are
    _queue_p2p = DualPipeVEngine._queue_p2p
    _exec_commit_p2p = DualPipeVEngine._exec_commit_p2p
    _phase = DualPipeVEngine._phase
    _exec_send_grads = DualPipeVEngine._exec_send_grads
    _exec_recv_grads = DualPipeVEngine._exec_recv_grads

    def __init__(self, *args, **kwargs):
        self._active_phase = _INIT  # the parent's p2p warm-up asks is_last_stage() topologically
        super().__init__(*args, **kwargs)
        self.layout = self.module.layout
        self.boundary = self.module.boundary
        assert not (self.is_pipe_partitioned or self.is_grad_partitioned), (
            "virtual stages do not support pipe_partitioned or grad_partitioned"
        )
        assert not self.dynamic_shape, "virtual stages allocate receives from static shapes"
        self._active_phase = None
        self._p2p_ops = []
        self._M = self.micro_batches  # micro-batches of the schedule being run
        self._shapes = None
        self._payload_dtype = torch.float32
        self.pipe_buffers["grads"] = []
        self.pipe_buffers["losses"] = []

    def set_payload_shapes(self, phase_shapes: list[dict], dtype: torch.dtype) -> None:
        """Per phase: the activation shape received and sent (``CachePlan.phase_shapes``)."""
        self._shapes = [
            {k: None if v is None else tuple(v) for k, v in d.items()} for d in phase_shapes
        ]
        self._payload_dtype = dtype

    # -- where this rank sits --------------------------------------------------------------

    def _chunk(self, phase: int) -> int:
        return self.layout.chunk_at(self.stage_id, phase)

    @property
    def _loss_phase(self) -> int:
        return self.layout.V - 1  # chunk C - 1 is the last chunk of its rank

    def is_last_stage(self):
        """True on the loss rank outside a phase (loss reduction), else in its loss phase."""
        if self._active_phase is _INIT:
            return super().is_last_stage()
        if self.stage_id != self.layout.head_rank:
            return False
        return self._active_phase is None or self._active_phase == self._loss_phase

    def _is_loss_stage(self, phase: int) -> bool:
        return self.stage_id == self.layout.head_rank and phase == self._loss_phase

    def _is_turn(self, phase: int) -> bool:
        chunk = self._chunk(phase)
        return chunk < self.layout.C - 1 and self.layout.is_local(chunk)

    def _downstream_stage(self, phase: int) -> int:
        return self.layout.rank_of(self._chunk(phase) + 1)

    def _upstream_stage(self, phase: int) -> int:
        return self.layout.rank_of(self._chunk(phase) - 1)

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.layout.head_rank)

    # -- schedules -------------------------------------------------------------------------

    def _train_schedule(self):
        lay, M = self.layout, self.micro_batches
        self._M = M
        if lay.placement == "vshape":
            return schedule.DualPipeVSchedule(M, self.num_stages, self.stage_id)
        return InterleavedSchedule(M, self.num_stages, self.stage_id, lay.V)

    def _inference_schedule(self, micro_batches):
        lay, P = self.layout, self.num_stages
        self._M = micro_batches
        if lay.placement == "looped":
            return InterleavedSchedule(micro_batches, P, self.stage_id, lay.V, forward_only=True)
        if micro_batches >= 2 * P:
            return schedule.DualPipeVSchedule(micro_batches, P, self.stage_id, forward_only=True)
        return SequentialForward(micro_batches, P, self.stage_id, lay.rank_of, lay.C)

    def eval_batch(self, *args, **kwargs):
        out = super().eval_batch(*args, **kwargs)
        self.boundary.check_empty()
        return out

    # -- instructions ----------------------------------------------------------------------

    def _exec_load_micro_batch(self, buffer_id):
        batch = self._next_batch()
        M = self._M
        if self.stage_id == 0 and buffer_id < M:  # chunk 0 is rank 0's phase 0
            self.pipe_buffers["inputs"][buffer_id] = batch[0].clone().to(self.device).detach()
        if self.stage_id == self.layout.head_rank:
            labels = batch[1]
            if torch.is_tensor(labels):
                labels = labels.to(self.device)
            else:
                labels = tuple(x.to(self.device).detach() for x in labels)
            self.pipe_buffers["labels"][self._loss_phase * M + buffer_id % M] = labels

    def _exec_forward_pass(self, buffer_id, phase):
        self.module.set_pass(phase, buffer_id % self._M)
        with self._phase(phase):
            super()._exec_forward_pass(buffer_id)
        outputs = self.pipe_buffers["outputs"][buffer_id]
        turn = self._is_turn(phase)
        if self._is_loss_stage(phase):
            if torch.is_grad_enabled():
                self.pipe_buffers["losses"][buffer_id] = self.loss
        elif turn:  # the successor chunk's input, detached: its graph stays its own
            handed = outputs.detach().requires_grad_(outputs.is_floating_point())
            self.pipe_buffers["inputs"][buffer_id + self._M] = handed
        if not torch.is_grad_enabled():
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if self._is_loss_stage(phase) or turn:
                self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id, phase):
        chunk, mb = self._chunk(phase), buffer_id % self._M
        extra_tensors, extra_grads = self.boundary.backward_extras(chunk, mb)
        if self._is_loss_stage(phase):
            if extra_tensors:
                raise RuntimeError(f"chunk {chunk} computes the loss but has extra gradients")
            self.loss = self.pipe_buffers["losses"][buffer_id]
            self.pipe_buffers["losses"][buffer_id] = None
            with self._phase(phase):
                super()._exec_backward_pass(buffer_id)
            self.pipe_buffers["labels"][buffer_id] = None
        else:
            if self._is_turn(phase):
                handed = self.pipe_buffers["inputs"][buffer_id + self._M]
                self.pipe_buffers["inputs"][buffer_id + self._M] = None
                grad = handed.grad
            else:
                grad = self.pipe_buffers["grads"][buffer_id]
                self.pipe_buffers["grads"][buffer_id] = None
            with self._phase(phase):
                self._backward(buffer_id, grad, list(extra_tensors), list(extra_grads))
        self.boundary.after_backward(chunk, mb)
        self.pipe_buffers["outputs"][buffer_id] = None
        if chunk == 0:  # nothing sends chunk 0's inputs on, so nothing else frees them
            self.pipe_buffers["inputs"][buffer_id] = None

    def _backward(self, buffer_id, grad, extra_tensors, extra_grads):
        """A non-loss chunk's backward: its outputs with the received gradient, plus extras."""
        outputs = [t for t in _as_list(self.pipe_buffers["outputs"][buffer_id])]
        grads = _as_list(grad)
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()  # as the parent: it does not call optimizer.backward
        self._running_engine_backward = True
        try:
            torch.autograd.backward(outputs + extra_tensors, grads + extra_grads)
        finally:
            self._running_engine_backward = False
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _exec_send_activations(self, buffer_id, phase):
        outputs = self.pipe_buffers["outputs"][buffer_id]
        expected = self._shapes[phase]["send"]
        if tuple(outputs.shape) != expected:
            raise PayloadError(
                f"chunk {self._chunk(phase)} produced {tuple(outputs.shape)}, but the plan "
                f"sends {expected} to chunk {self._chunk(phase) + 1}"
            )
        self._queue_p2p(dist.isend, [outputs], self._downstream_stage(phase))
        if not torch.is_grad_enabled():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, phase):
        shape = self._shapes[phase]["recv"]
        received = torch.empty(
            shape, dtype=self._payload_dtype, device=self.device, requires_grad=True
        )
        self._queue_p2p(dist.irecv, [received], self._upstream_stage(phase))
        self.pipe_buffers["inputs"][buffer_id] = received

    def _exec_optimizer_step(self, lr_kwargs=None):
        self.boundary.check_empty()  # every cached block consumed and its gradient delivered
        super()._exec_optimizer_step(lr_kwargs)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        schedule.LoadMicroBatch: _exec_load_micro_batch,
        schedule.ForwardPass: _exec_forward_pass,
        schedule.BackwardPass: _exec_backward_pass,
        schedule.SendActivation: _exec_send_activations,
        schedule.RecvActivation: _exec_recv_activations,
        schedule.SendGrad: DualPipeVEngine._exec_send_grads,
        schedule.RecvGrad: DualPipeVEngine._exec_recv_grads,
        schedule.CommitP2P: DualPipeVEngine._exec_commit_p2p,
    }


def initialize(model, optimizer, lr_scheduler, config: dict) -> VirtualPipeEngine:
    """``deepspeed.initialize``'s pipeline branch, with this engine class instead of its own."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.zero.partition_parameters.shutdown_init_context()
    config_class = DeepSpeedConfig(config, model.mpu())
    deepspeed.set_optimizer_flags(config_class, model)
    engine = VirtualPipeEngine(
        args=None,
        model=model,
        optimizer=optimizer,
        model_parameters=None,
        training_data=None,
        lr_scheduler=lr_scheduler,
        mpu=model.mpu(),
        dist_init_required=None,
        collate_fn=None,
        config=config,
        config_class=config_class,
    )
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine
