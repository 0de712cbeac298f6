"""Execute a pipeline schedule's instruction stream on a real process group, with fake work.

``execute`` runs one rank's DeepSpeed ``PipeSchedule`` the way the pipeline engines do, minus
the model: ``ForwardPass`` / ``BackwardPass`` sleep for a given cost, and every send, receive
and ``CommitP2P`` is real point-to-point communication on the default process group:

* with ``CommitP2P`` in the stream (DualPipeV, interleaved) sends and receives are queued, per
  phase and micro-batch, to the peer that holds the neighbouring chunk, and each commit posts
  its queue as one ``batch_isend_irecv`` and waits for all of it, as ``DualPipeVEngine`` does;
  without it (``TrainSchedule``) each send or receive is posted and waited for on its own;
* every message is a tensor whose shape is the payload of its transition (``shape_of``, e.g.
  a ``CachePlan``'s static shapes, so shapes differ from one hand-over to the next) and whose
  every element holds one code for (kind, producing chunk, micro-batch, sending rank);
* a receive knows from its instruction (phase, buffer, or its rank in the stream for cyclic
  1F1B buffers) which message it must get; after the commit the content is compared, so a
  message paired with the wrong receive raises ``MessageOrderError``, naming both;
* a pass whose input (or gradient) has not arrived by a completed commit raises too.

A deadlock surfaces as the process group's timeout. The result holds the rank's compute
intervals on the machine's monotonic clock (shared by the processes of one host), so the
ranks' results together give the schedule's bubble as measured on real communication.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds

KINDS = ("act", "grad")


class MessageOrderError(AssertionError):
    """A receive got another message than its instruction expects, or a pass lacks its input."""


@dataclass
class Pass:
    forward: bool
    chunk: int
    micro_batch: int
    start: float
    end: float


@dataclass
class ExecResult:
    rank: int
    passes: list[Pass] = field(default_factory=list)
    received: int = 0
    sent: int = 0
    commits: int = 0
    start: float = 0.0
    end: float = 0.0

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "passes": [vars(p) for p in self.passes],
            "received": self.received,
            "sent": self.sent,
            "commits": self.commits,
            "start": self.start,
            "end": self.end,
        }


def message_code(kind: str, chunk: int, micro_batch: int, sender: int, C: int, M: int, P: int):
    """One number per message (exact in float32 for any realistic C, M, P)."""
    return float(1 + ((KINDS.index(kind) * C + chunk) * M + micro_batch) * P + sender)


def build_schedule(name: str, P: int, rank: int, M: int, V: int = 2):
    """(schedule, chunk_of(rank, phase), C, phased) of 1f1b | dualpipev | interleaved."""
    from attnres_dist.pipeline.interleaved_schedule import InterleavedSchedule
    from attnres_dist.pipeline.virtual_layout import rank_chunks

    if name == "1f1b":
        return ds.TrainSchedule(M, P, rank), (lambda r, phase: r), P, False
    if name == "dualpipev":
        sched = ds.DualPipeVSchedule(M, P, rank)
        return sched, (lambda r, phase: rank_chunks("vshape", P, 2, r)[phase]), 2 * P, True
    if name == "interleaved":
        sched = InterleavedSchedule(M, P, rank, V)
        return sched, (lambda r, phase: rank_chunks("looped", P, V, r)[phase]), P * V, True
    raise ValueError(f"unknown schedule {name!r}; allowed: 1f1b, dualpipev, interleaved")


class _Executor:
    def __init__(self, rank, P, chunk_of, C, M, shape_of, costs, phased):
        self.rank, self.P, self.C, self.M, self.phased = rank, P, C, M, phased
        self.chunk_of, self.shape_of, self.costs = chunk_of, shape_of, costs
        self.rank_of = {chunk_of(r, p): r for r in range(P) for p in range(C // P)}
        self.inputs: dict[int, int] = {}  # buffer -> micro-batch whose input is here
        self.outputs: dict[int, int] = {}  # buffer -> micro-batch forwarded from it
        self.grads: dict[int, int] = {}  # buffer -> micro-batch whose output gradient is here
        self.fwd, self.bwd = set(), set()  # (chunk, micro-batch) done on this rank
        self.loads = 0
        self.counters: dict[tuple[str, str, int], int] = {}  # (op, kind, phase) -> next mb
        self.queue: list = []  # P2POps of the next commit
        self.pending: list = []  # (tensor, expected code, on_arrival, description)
        self.result = ExecResult(rank)

    def fail(self, msg):
        raise MessageOrderError(f"rank {self.rank}: {msg}")

    def micro_batch(self, op: str, kind: str, cmd) -> int:
        """The micro-batch an instruction works on: its buffer's (phased) or its turn (1F1B)."""
        phase = getattr(cmd, "phase", 0)
        key = (op, kind, phase)
        turn = self.counters.get(key, 0)
        self.counters[key] = turn + 1
        if not self.phased:
            return turn
        mb = cmd.buffer_id - phase * self.M
        if not 0 <= mb < self.M:
            self.fail(f"{cmd}: buffer {cmd.buffer_id} is outside phase {phase}")
        return mb

    def chunk(self, cmd) -> int:
        return self.chunk_of(self.rank, getattr(cmd, "phase", 0))

    def tensor(self, src_chunk: int, code: float | None = None) -> torch.Tensor:
        shape = tuple(self.shape_of(src_chunk))
        if code is None:
            return torch.full(shape, float("nan"))
        return torch.full(shape, code)

    def code(self, kind, chunk, mb, sender):
        return message_code(kind, chunk, mb, sender, self.C, self.M, self.P)

    def post(self, ops):
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        self.result.commits += 1
        pending, self.pending = self.pending, []
        for tensor, expected, arrived, what in pending:
            got = tensor.flatten()
            if not bool((got == expected).all()):
                self.fail(f"{what}: expected message {expected:g}, got {got[0].item():g}")
            arrived()
            self.result.received += 1

    def p2p(self, op, tensor, peer, expected=None, arrived=None, what=""):
        self.queue.append(dist.P2POp(op, tensor, peer))
        if op is dist.irecv:
            self.pending.append((tensor, expected, arrived, what))
        else:
            self.result.sent += 1
        if not self.batched:
            ops, self.queue = self.queue, []
            self.post(ops)

    def compute(self, forward, chunk, mb):
        start = time.monotonic()
        cost = self.costs[0 if forward else 1]
        if cost:
            time.sleep(cost)
        self.result.passes.append(Pass(forward, chunk, mb, start, time.monotonic()))

    def run(self, schedule) -> ExecResult:
        stream = [cmd for step in schedule for cmd in step]
        self.batched = any(isinstance(c, ds.CommitP2P) for c in stream)
        self.result.start = time.monotonic()
        for cmd in stream:
            self.step(cmd)
        self.result.end = time.monotonic()
        mine = [c for c in range(self.C) if self.rank_of[c] == self.rank]
        expected = {(c, m) for c in mine for m in range(self.M)}
        if self.fwd != expected or self.bwd != expected:
            missing = (expected - self.fwd, expected - self.bwd)
            self.fail(f"passes missing: forward {missing[0]}, backward {missing[1]}")
        if self.queue or self.pending:
            self.fail(f"{len(self.queue)} p2p operations never committed")
        return self.result

    def step(self, cmd):  # noqa: C901  (one branch per instruction type)
        rank, rank_of = self.rank, self.rank_of
        if isinstance(cmd, ds.LoadMicroBatch):
            if rank_of[0] == rank and self.chunk(cmd) == 0:
                if self.phased and cmd.buffer_id != self.loads:
                    self.fail(f"{cmd}: micro-batch {self.loads} belongs in buffer {self.loads}")
                self.inputs[cmd.buffer_id] = self.loads
                self.loads += 1
        elif isinstance(cmd, ds.ForwardPass):
            chunk, mb = self.chunk(cmd), self.micro_batch("pass", "fwd", cmd)
            local = chunk > 0 and rank_of[chunk - 1] == rank
            if local and (chunk - 1, mb) not in self.fwd:
                self.fail(f"chunk {chunk} mb {mb} before chunk {chunk - 1} ran it here")
            if not local and self.inputs.get(cmd.buffer_id) != mb:
                self.fail(f"forward of chunk {chunk} mb {mb} with no input committed")
            if (chunk, mb) in self.fwd:
                self.fail(f"chunk {chunk} mb {mb} forwarded twice")
            self.compute(True, chunk, mb)
            self.fwd.add((chunk, mb))
            self.outputs[cmd.buffer_id] = mb
        elif isinstance(cmd, ds.BackwardPass):
            chunk, mb = self.chunk(cmd), self.micro_batch("pass", "bwd", cmd)
            if (chunk, mb) not in self.fwd or (chunk, mb) in self.bwd:
                self.fail(f"backward of chunk {chunk} mb {mb}: not forwarded, or done twice")
            if chunk < self.C - 1:
                if rank_of[chunk + 1] == rank:
                    if (chunk + 1, mb) not in self.bwd:
                        self.fail(f"backward of chunk {chunk} mb {mb} before chunk {chunk + 1}'s")
                elif self.grads.get(cmd.buffer_id) != mb:
                    self.fail(f"backward of chunk {chunk} mb {mb} with no gradient committed")
            self.compute(False, chunk, mb)
            self.bwd.add((chunk, mb))
        elif isinstance(cmd, ds.SendActivation):
            chunk, mb = self.chunk(cmd), self.micro_batch("send", "act", cmd)
            if (chunk, mb) not in self.fwd or self.outputs.get(cmd.buffer_id) != mb:
                self.fail(f"{cmd}: chunk {chunk} mb {mb} has not run forward")
            code = self.code("act", chunk, mb, rank)
            self.p2p(dist.isend, self.tensor(chunk, code), rank_of[chunk + 1])
        elif isinstance(cmd, ds.SendGrad):
            chunk, mb = self.chunk(cmd), self.micro_batch("send", "grad", cmd)
            if (chunk, mb) not in self.bwd:
                self.fail(f"{cmd}: chunk {chunk} mb {mb} has not run backward")
            code = self.code("grad", chunk, mb, rank)
            self.p2p(dist.isend, self.tensor(chunk - 1, code), rank_of[chunk - 1])
        elif isinstance(cmd, ds.RecvActivation):
            chunk, mb = self.chunk(cmd), self.micro_batch("recv", "act", cmd)
            peer = rank_of[chunk - 1]
            expected = self.code("act", chunk - 1, mb, peer)
            buf = cmd.buffer_id

            def arrived(buf=buf, mb=mb):
                self.inputs[buf] = mb

            what = f"{cmd} (activation of chunk {chunk - 1} mb {mb} from rank {peer})"
            self.p2p(dist.irecv, self.tensor(chunk - 1), peer, expected, arrived, what)
        elif isinstance(cmd, ds.RecvGrad):
            chunk, mb = self.chunk(cmd), self.micro_batch("recv", "grad", cmd)
            if (chunk, mb) not in self.fwd:
                self.fail(f"{cmd}: gradient for chunk {chunk} mb {mb} before its forward")
            peer = rank_of[chunk + 1]
            expected = self.code("grad", chunk + 1, mb, peer)
            buf = cmd.buffer_id

            def arrived(buf=buf, mb=mb):
                self.grads[buf] = mb

            what = f"{cmd} (gradient of chunk {chunk + 1} mb {mb} from rank {peer})"
            self.p2p(dist.irecv, self.tensor(chunk), peer, expected, arrived, what)
        elif isinstance(cmd, ds.CommitP2P):
            ops, self.queue = self.queue, []
            if ops:
                self.post(ops)


def execute(
    schedule,
    rank: int,
    chunk_of,
    C: int,
    micro_batches: int,
    shape_of,
    forward_cost: float = 0.0,
    backward_cost: float = 0.0,
    phased: bool = True,
) -> ExecResult:
    """Run ``schedule`` (this rank's) on the default process group; see the module docstring.

    ``chunk_of(rank, phase)`` -> chunk, for every rank; ``shape_of(c)`` -> the payload shape
    of the hand-over c -> c + 1 (its gradient has the same shape); costs in seconds per pass.
    """
    P = dist.get_world_size()
    costs = (forward_cost, backward_cost)
    ex = _Executor(rank, P, chunk_of, C, micro_batches, shape_of, costs, phased)
    return ex.run(schedule)


def measured_bubble(results: list[dict]) -> float:
    """Idle fraction of the ranks between the first pass's start and the last pass's end."""
    passes = [p for r in results for p in r["passes"]]
    busy = sum(p["end"] - p["start"] for p in passes)
    span = max(p["end"] for p in passes) - min(p["start"] for p in passes)
    return 1.0 - busy / (len(results) * span)
