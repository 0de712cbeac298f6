"""A tap on the wire between pipeline stages: what DeepSpeed's engine really sends and receives.

DeepSpeed's pipeline engine moves every activation and gradient through
``deepspeed.runtime.pipe.p2p.send`` / ``recv``, looked up on the ``p2p`` module at each call
(``from . import p2p``), so replacing those two module attributes sees every tensor that crosses
a stage boundary, with its exact shape, dtype and byte count as handed to the process group.

``WireTap`` also wraps the engine's four communication instructions (SendActivation,
RecvActivation, SendGrad, RecvGrad) so that the tensors of one instruction form one
``Transfer``: the payload of one micro-batch in one direction, however many tensors it has
(one when packed, ``k`` as a tuple). Shape metadata that DeepSpeed sends before the first
payload (``_send_tensor_meta``) is counted separately, because it is not part of the
activation contract and is sent once per engine.

Virtual-stage engines (``parallel.schedule`` dualpipev | interleaved) queue their tensors with
``_queue_p2p`` and launch them at ``CommitP2P`` as one ``batch_isend_irecv``, as DeepSpeed's
``DualPipeVEngine`` does: there the tap wraps ``_queue_p2p`` (bytes and shapes, per
instruction) and the commit instruction (the time every queued transfer took on the wire), and
names each transfer by its hand-over (``chunk`` = the transition's sending chunk) and its
micro-batch (from the buffer, ``phase * M + micro_batch``), since one pair of ranks carries
several transitions.

Used by the profiler (``attnres_dist.profile``) and the pipeline benchmark; both compare the
bytes recorded here with ``attnres_dist.pipeline.contract.boundary_specs``. With tensor
parallelism DeepSpeed splits each payload over the tensor-parallel ranks (its
``pipe_partitioned`` / ``grad_partitioned`` options, on by default): ``expected_wire_bytes``
gives what each rank then sends.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

# engine instruction -> (operation on this rank, direction of the data flow)
COMM_INSTRUCTIONS = {
    "SendActivation": ("send", "forward"),
    "RecvActivation": ("recv", "forward"),
    "SendGrad": ("send", "backward"),
    "RecvGrad": ("recv", "backward"),
}


@dataclass
class Transfer:
    """One micro-batch's payload through one boundary, as seen by one rank."""

    rank: int
    stage: int
    peer_stage: int
    op: str  # send | recv
    direction: str  # forward (activations) | backward (gradients)
    step: int  # set by ``WireTap.begin_step``; -1 before the first call
    micro_batch: int  # n-th transfer of this (op, direction) in the step (1F1B keeps order)
    start: float  # monotonic seconds: start of the first payload p2p call
    end: float  # end of the last payload p2p call
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    nbytes: int = 0
    meta_bytes: int = 0  # shape metadata sent/received inside the same instruction
    chunk: int = -1  # virtual stages: the transition's sending chunk (c of c -> c + 1)

    @property
    def num_tensors(self) -> int:
        return len(self.shapes)

    @property
    def boundary(self) -> tuple[int, int]:
        """(sending stage, receiving stage) of the boundary in forward orientation."""
        return stage_pair(self.op, self.direction, self.stage, self.peer_stage)

    def to_dict(self) -> dict:
        return asdict(self)


def stage_pair(op: str, direction: str, stage: int, peer_stage: int) -> tuple[int, int]:
    """The boundary (earlier stage, later stage) a transfer crosses; gradients flow backward."""
    if (op == "send") == (direction == "forward"):
        return (stage, peer_stage)
    return (peer_stage, stage)


def expected_wire_bytes(shape, itemsize: int, tp: int, partitioned: bool) -> list[int]:
    """Bytes each tensor-parallel rank sends for one payload of ``shape`` (index = tp rank).

    Partitioned, DeepSpeed sends a flat slice (``partition_uniform``) plus a long tensor of
    metadata: ndims, the shape, the number of parts, the rank and the ``parts + 1`` offsets.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    if tp == 1 or not partitioned:
        return [numel * itemsize] * tp
    from deepspeed.runtime.utils import partition_uniform

    parts = partition_uniform(num_items=numel, num_parts=tp)
    meta = (1 + len(shape) + 2 + len(parts)) * 8
    return [(parts[r + 1] - parts[r]) * itemsize + meta for r in range(tp)]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class WireTap:
    """Records every p2p tensor of the attached engines while active (a context manager).

    ``with WireTap(engines) as tap: ...`` then ``tap.transfers``. Engines must be DeepSpeed
    ``PipelineEngine`` objects; several may share one tap (their transfers interleave in call
    order). Stray p2p calls outside a communication instruction are kept in ``tap.stray``.
    """

    def __init__(self, engines, rank: int | None = None):
        self.engines = list(engines)
        self.rank = rank if rank is not None else _global_rank()
        self.transfers: list[Transfer] = []
        self.stray: list[dict] = []
        self._current: Transfer | None = None
        self._in_meta = False
        self._counters: dict[tuple[str, str], int] = {}
        self._restore: list = []
        self._uncommitted: list[Transfer] = []  # virtual engines: queued, not yet committed
        self.enabled = True
        self.step = -1

    def begin_step(self, step: int) -> None:
        """Number the following transfers as micro-batches 0, 1, ... of ``step``."""
        self.step = step
        self._counters.clear()

    # -- installation ------------------------------------------------------------------------

    def __enter__(self) -> WireTap:
        from deepspeed.runtime.pipe import p2p

        self._patch(p2p, "send", self._wrap_p2p(p2p.send, "send"))
        self._patch(p2p, "recv", self._wrap_p2p(p2p.recv, "recv"))
        for engine in self.engines:
            if is_virtual_engine(engine):
                self._patch(engine, "_queue_p2p", self._wrap_queue(engine._queue_p2p))
            self._patch(engine, "_send_tensor_meta", self._wrap_meta(engine._send_tensor_meta))
            self._patch(engine, "_recv_tensor_meta", self._wrap_meta(engine._recv_tensor_meta))
            # the map is a class attribute; an instance copy leaves other engines untouched
            table = dict(engine._INSTRUCTION_MAP)
            for instr_type, fn in list(table.items()):
                name = instr_type.__name__
                if name in COMM_INSTRUCTIONS and is_virtual_engine(engine):
                    table[instr_type] = self._wrap_virtual_instruction(fn, engine, name)
                elif name in COMM_INSTRUCTIONS:
                    table[instr_type] = self._wrap_instruction(fn, engine, name)
                elif name == "CommitP2P" and is_virtual_engine(engine):
                    table[instr_type] = self._wrap_commit(fn)
            self._patch(engine, "_INSTRUCTION_MAP", table)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, old, had in reversed(self._restore):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._restore.clear()

    def _patch(self, obj, name: str, new) -> None:
        had = name in vars(obj)
        self._restore.append((obj, name, vars(obj).get(name), had))
        setattr(obj, name, new)

    # -- wrappers ----------------------------------------------------------------------------

    def _wrap_instruction(self, fn, engine, instr_name: str):
        op, direction = COMM_INSTRUCTIONS[instr_name]
        tap = self

        def instruction(self_engine, *args, **kwargs):
            if not tap.enabled:
                return fn(self_engine, *args, **kwargs)
            forward_peer = engine.next_stage if op == "send" else engine.prev_stage
            backward_peer = engine.prev_stage if op == "send" else engine.next_stage
            peer = forward_peer if direction == "forward" else backward_peer
            key = (op, direction)
            index = tap._counters.get(key, 0)
            tap._counters[key] = index + 1
            tap._current = Transfer(
                tap.rank, engine.stage_id, peer, op, direction, tap.step, index, 0.0, 0.0
            )
            try:
                return fn(self_engine, *args, **kwargs)
            finally:
                tap.transfers.append(tap._current)
                tap._current = None

        return instruction

    def _wrap_virtual_instruction(self, fn, engine, instr_name: str):
        op, direction = COMM_INSTRUCTIONS[instr_name]
        tap = self

        def instruction(self_engine, buffer_id, phase, **kwargs):
            if not tap.enabled:
                return fn(self_engine, buffer_id, phase, **kwargs)
            chunk = engine.layout.chunk_at(engine.stage_id, phase)
            downstream = (op == "send") == (direction == "forward")
            peer = engine.layout.rank_of(chunk + 1 if downstream else chunk - 1)
            M = getattr(engine, "_M", engine.micro_batches)
            tap._current = Transfer(
                tap.rank,
                engine.stage_id,
                peer,
                op,
                direction,
                tap.step,
                buffer_id - phase * M,
                0.0,
                0.0,
                chunk=chunk if downstream else chunk - 1,
            )
            try:
                return fn(self_engine, buffer_id, phase, **kwargs)
            finally:
                tap.transfers.append(tap._current)
                tap._uncommitted.append(tap._current)
                tap._current = None

        return instruction

    def _wrap_commit(self, fn):
        tap = self

        def commit(self_engine, *args, **kwargs):
            start = time.monotonic()
            try:
                return fn(self_engine, *args, **kwargs)
            finally:
                end = time.monotonic()
                for t in tap._uncommitted:  # every queued transfer travels in this batch
                    t.start, t.end = start, end
                tap._uncommitted.clear()

        return commit

    def _wrap_queue(self, fn):
        tap = self

        def queue(op, tensors, stage, *args, **kwargs):
            if tap.enabled:
                now = time.monotonic()
                kind = tap._current.op if tap._current is not None else "queued"
                for tensor in tensors:
                    tap._record(kind, tensor, stage, now, now)
            return fn(op, tensors, stage, *args, **kwargs)

        return queue

    def _wrap_meta(self, fn):
        tap = self

        def meta(*args, **kwargs):
            tap._in_meta = True
            try:
                return fn(*args, **kwargs)
            finally:
                tap._in_meta = False

        return meta

    def _wrap_p2p(self, fn, op: str):
        tap = self

        def p2p_call(tensor, stage, *args, **kwargs):
            start = time.monotonic()
            result = fn(tensor, stage, *args, **kwargs)
            end = time.monotonic()
            if tap.enabled:
                tap._record(op, tensor, stage, start, end)
            return result

        return p2p_call

    def _record(self, op: str, tensor: torch.Tensor, stage: int, start: float, end: float):
        current = self._current
        nbytes = tensor_nbytes(tensor)
        if current is None:
            self.stray.append({"op": op, "peer_stage": stage, "nbytes": nbytes})
            return
        if self._in_meta:
            current.meta_bytes += nbytes
            return
        if not current.shapes:
            current.start = start
        current.end = end
        current.shapes.append(list(tensor.shape))
        current.dtypes.append(str(tensor.dtype).split(".")[-1])
        current.nbytes += nbytes


def is_virtual_engine(engine) -> bool:
    """A virtual-stage engine: a layout of model chunks and DualPipeV's queued p2p."""
    return hasattr(engine, "layout") and hasattr(engine, "_queue_p2p")


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def bytes_by_boundary(transfers: list[Transfer]) -> dict[tuple[int, int, str, str], set[int]]:
    """{(sender, receiver, direction, op): {bytes per micro-batch seen}}: one value if uniform."""
    seen: dict[tuple[int, int, str, str], set[int]] = {}
    for t in transfers:
        sender, receiver = t.boundary
        seen.setdefault((sender, receiver, t.direction, t.op), set()).add(t.nbytes)
    return seen
