"""A stalled or lost pipeline neighbour becomes one clear error instead of a hang or a raw trace.

DeepSpeed's pipeline engine executes its schedule through the class-level ``_INSTRUCTION_MAP``
(instruction type -> handler). The four handlers that wait on a neighbouring stage (receive and
send of activations and of gradients) are wrapped on one engine instance only. Every wait is
bounded by the process group's timeout, ``parallel.timeout_s``: gloo then raises "Timed out
waiting ...", and when the neighbour's process is gone it raises "Connection closed by peer".
Either is re-raised as ``StageWaitError`` naming this stage, the neighbour and the boundary
(how many layers lie before it), which is what a user needs to find the stuck or dead rank.

With NCCL a timed-out operation is aborted by the process group's own watchdog instead; the
wrapping is harmless there.
"""

from __future__ import annotations

import functools

from attnres_dist.errors import TrainingHalted

_TIMED_OUT = ("timed out", "timeout")
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "closed by peer")


class StageWaitError(TrainingHalted):
    """A pipeline stage waited too long for, or lost, its neighbour."""


def boundary_text(parts: list[int], left: int, num_layers: int) -> str:
    """The boundary between stage ``left`` and ``left + 1`` in words."""
    layers_done = parts[left + 1] - 1  # part 0 is the embedding
    return f"boundary {left}->{left + 1} (after {layers_done} of {num_layers} layers)"


def _explain(exc: Exception, stage: int, rank: int, verb: str, other: int, where: str, t: int):
    text = str(exc)
    lowered = text.lower()
    me = f"stage {stage} (rank {rank})"
    if any(word in lowered for word in _TIMED_OUT):
        return (
            f"{me} waited more than {t} s to {verb} stage {other} at {where}; stage {other} "
            "is stalled or far slower (raise parallel.timeout_s if it is just slow)"
        )
    if any(word in lowered for word in _PEER_GONE):
        return (
            f"{me} lost stage {other} while trying to {verb} it at {where}: the connection "
            f"closed, so that rank crashed or was killed (see its log)"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{me} failed to {verb} stage {other} at {where}: {first}"


def install(engine, parts: list[int], num_layers: int, timeout_s: int) -> None:
    """Wrap ``engine``'s neighbour-waiting instruction handlers (a DeepSpeed PipelineEngine)."""
    from deepspeed.runtime.pipe import schedule

    stage, num_stages, rank = engine.stage_id, engine.num_stages, engine.global_rank
    handlers = dict(type(engine)._INSTRUCTION_MAP)
    for instruction, verb, offset in (
        (schedule.RecvActivation, "receive activations from", -1),
        (schedule.SendActivation, "send activations to", 1),
        (schedule.RecvGrad, "receive gradients from", 1),
        (schedule.SendGrad, "send gradients to", -1),
    ):
        other = stage + offset
        if not 0 <= other < num_stages:
            continue
        where = boundary_text(parts, min(stage, other), num_layers)
        handlers[instruction] = _guarded(
            handlers[instruction], stage, rank, verb, other, where, timeout_s
        )
    # an instance attribute shadows the class's map for this engine only
    engine._INSTRUCTION_MAP = handlers


def _guarded(handler, stage: int, rank: int, verb: str, other: int, where: str, timeout_s: int):
    @functools.wraps(handler)
    def run(self, *args, **kwargs):
        try:
            return handler(self, *args, **kwargs)
        except RuntimeError as exc:
            message = _explain(exc, stage, rank, verb, other, where, timeout_s)
            raise StageWaitError("pipeline", message) from exc

    return run


def install_virtual(engine, timeout_s: int) -> None:
    """The same for a virtual-stage engine (``virtual_engine.py``), whose sends and receives
    only queue: the wait happens in ``CommitP2P``, which is wrapped to name the peers and the
    chunks of the queued messages."""
    from deepspeed.runtime.pipe import schedule

    handlers = dict(type(engine)._INSTRUCTION_MAP)
    commit = handlers[schedule.CommitP2P]

    @functools.wraps(commit)
    def run(self, *args, **kwargs):
        peers = sorted({self.grid._topo.get_coord(op.peer).pipe for op in self._p2p_ops})
        try:
            return commit(self, *args, **kwargs)
        except RuntimeError as exc:
            lay = self.layout
            chunks = ", ".join(str(c) for c in lay.chunks_of(self.stage_id))
            where = f"a batched exchange of rank {self.global_rank}'s chunks {chunks}"
            other = "/".join(str(p) for p in peers) or "?"
            message = _explain(
                exc, self.stage_id, self.global_rank, "exchange with", other, where, timeout_s
            )
            raise StageWaitError("pipeline", message) from exc

    handlers[schedule.CommitP2P] = run
    engine._INSTRUCTION_MAP = handlers
