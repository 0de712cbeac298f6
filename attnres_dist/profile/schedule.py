"""Timers on DeepSpeed's pipeline schedule: one event per executed instruction.

DeepSpeed's ``PipelineEngine._exec_schedule`` dispatches each instruction of the 1F1B schedule
through ``self._INSTRUCTION_MAP`` (instruction type -> unbound method). ``ScheduleTimer``
installs a per-engine copy of that map whose entries time the original handler, so forward,
backward, send, receive, gradient reduction and the optimizer step of every micro-batch become
``Event`` records with monotonic start and end times, without touching DeepSpeed's code.

The n-th ForwardPass (BackwardPass, SendActivation, ...) of a step is micro-batch n: the
1F1B schedule processes micro-batches in order in each instruction stream. Virtual-stage
engines (a ``layout`` of model chunks) give each instruction a phase: the event then names its
chunk and the micro-batch of its buffer (``phase * M + micro_batch``); ``CommitP2P``, where
their queued transfers travel, is the ``commit`` event.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from attnres_dist.profile.wire import is_virtual_engine

# instruction class name -> event kind used in reports and plots
KINDS = {
    "LoadMicroBatch": "load",
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "SendActivation": "send_act",
    "RecvActivation": "recv_act",
    "SendGrad": "send_grad",
    "RecvGrad": "recv_grad",
    "ReduceTiedGrads": "reduce_tied",
    "ReduceGrads": "reduce_grads",
    "OptimizerStep": "optimizer",
    "CommitP2P": "commit",
}
COMPUTE_KINDS = ("forward", "backward")
COMM_KINDS = ("send_act", "recv_act", "send_grad", "recv_grad")  # "commit": virtual engines
OTHER_KINDS = ("load", "reduce_tied", "reduce_grads", "optimizer")


@dataclass
class Event:
    rank: int
    stage: int
    step: int
    kind: str
    micro_batch: int  # -1 for once-per-step instructions (reduce, optimizer)
    start: float  # monotonic seconds
    end: float
    chunk: int = -1  # virtual stages: the model chunk of the instruction's phase

    def to_dict(self) -> dict:
        return asdict(self)


class ScheduleTimer:
    """Times every instruction of one engine while active (a context manager).

    Installs on top of whatever map the engine currently has, so it composes with ``WireTap``
    (enter the tap first). ``record_function`` labels also make the instructions visible in a
    torch.profiler trace.
    """

    def __init__(self, engine, rank: int):
        self.engine = engine
        self.rank = rank
        self.events: list[Event] = []
        self.steps: list[tuple[int, float, float]] = []  # (step, start, end) of train_batch
        self.enabled = True
        self._step = -1
        self._counts: dict[str, int] = {}
        self._had_map = False
        self._old_map = None

    def __enter__(self) -> ScheduleTimer:
        engine = self.engine
        self._had_map = "_INSTRUCTION_MAP" in vars(engine)
        self._old_map = vars(engine).get("_INSTRUCTION_MAP")
        table = dict(engine._INSTRUCTION_MAP)
        for instr_type, fn in list(table.items()):
            kind = KINDS.get(instr_type.__name__, instr_type.__name__)
            table[instr_type] = self._wrap(fn, kind)
        engine._INSTRUCTION_MAP = table
        return self

    def __exit__(self, *exc) -> None:
        if self._had_map:
            self.engine._INSTRUCTION_MAP = self._old_map
        else:
            del self.engine._INSTRUCTION_MAP

    def _wrap(self, fn, kind: str):
        timer = self
        per_micro_batch = kind not in ("reduce_tied", "reduce_grads", "optimizer", "commit")
        layout = self.engine.layout if is_virtual_engine(self.engine) else None

        def instruction(self_engine, *args, **kwargs):
            # the label is always there, so torch.profiler traces show the schedule too
            with torch.profiler.record_function(f"pipe:{kind}"):
                if not timer.enabled:
                    return fn(self_engine, *args, **kwargs)
                index, chunk = -1, -1
                if per_micro_batch and layout is not None and "phase" in kwargs:
                    phase = kwargs["phase"]
                    chunk = layout.chunk_at(self_engine.stage_id, phase)
                    M = getattr(self_engine, "_M", self_engine.micro_batches)
                    index = kwargs["buffer_id"] - phase * M
                elif per_micro_batch:
                    index = timer._counts.get(kind, 0)
                    timer._counts[kind] = index + 1
                start = time.monotonic()
                result = fn(self_engine, *args, **kwargs)
                end = time.monotonic()
            timer.events.append(
                Event(timer.rank, self_engine.stage_id, timer._step, kind, index, start, end, chunk)
            )
            return result

        return instruction

    def run_step(self, step: int, fn):
        """Run ``fn()`` (one ``train_batch``) as measured step ``step``."""
        self._step = step
        self._counts.clear()
        start = time.monotonic()
        result = fn()
        end = time.monotonic()
        if self.enabled:
            self.steps.append((step, start, end))
        return result
