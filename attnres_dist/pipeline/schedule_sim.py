"""Run the instruction streams of a DeepSpeed pipeline schedule on all ranks, without processes.

``simulate`` executes every rank's ``PipeSchedule`` instructions together with an event-driven
clock and the semantics of the engines that run them:

* point-to-point messages are matched first in, first out per ordered pair of ranks, as NCCL
  matches them (and gloo with one tag): the n-th send from a to b meets the n-th receive on b
  from a, and the receive must be expecting exactly that (kind, chunk, micro-batch);
* with ``CommitP2P`` in a stream, sends and receives only queue; the commit posts them as one
  batch and blocks until every one of them is matched (``batch_isend_irecv`` + ``wait``);
  without it (``TrainSchedule``) each send or receive is its own blocking batch;
* ``ReduceTiedGrads`` is a barrier of all ranks; ``ForwardPass`` / ``BackwardPass`` take the
  cost given per chunk pass; everything else takes no time.

It checks that each (chunk, micro-batch) runs forward once and backward once, backward after
forward and after the gradient arrived, that the optimizer step comes last, and raises
``ScheduleError`` on a deadlock (naming the blocked ranks and what they wait for). The result
holds the compute timeline under blocking communication and, from the same per-rank orders,
the ideal timeline with free, non-blocking communication: the schedule's own bubble.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from fractions import Fraction

from deepspeed.runtime.pipe import schedule as ds


class ScheduleError(AssertionError):
    """The instruction streams break the pipeline's rules (mismatch, deadlock, order)."""


@dataclass(frozen=True)
class Interval:
    rank: int
    forward: bool
    chunk: int
    micro_batch: int
    start: Fraction
    end: Fraction


@dataclass
class SimResult:
    P: int
    C: int
    M: int
    blocking: list[Interval]
    ideal: list[Interval]
    messages: int
    orders: list[list[tuple[bool, int, int]]] = field(default_factory=list)  # per rank

    @staticmethod
    def _bubble(intervals: list[Interval], P: int) -> Fraction:
        busy = sum(i.end - i.start for i in intervals)
        span = max(i.end for i in intervals) - min(i.start for i in intervals)
        return 1 - busy / (P * span)

    @property
    def bubble(self) -> Fraction:
        """Idle fraction of the P ranks over the step, with free asynchronous communication."""
        return self._bubble(self.ideal, self.P)

    @property
    def blocking_bubble(self) -> Fraction:
        return self._bubble(self.blocking, self.P)

    @property
    def makespan(self) -> Fraction:
        return max(i.end for i in self.ideal)


@dataclass
class _Op:
    rank: int
    send: bool
    peer: int
    label: tuple  # (kind, producing chunk, micro-batch or None: learnt from the send)
    on_done: object = None  # receives: called with the matched send's label
    posted: Fraction = Fraction(0)
    matched_at: Fraction | None = None


def simulate(schedules, chunk_of, C, micro_batches, forward_cost=1, backward_cost=2, phased=True):
    """Execute ``schedules`` (one per rank) together; ``chunk_of(rank, phase)`` -> chunk.

    ``phased``: buffers are ``phase * M + micro_batch`` (DualPipeV, interleaved) and every
    instruction's buffer is checked against it; otherwise buffers are cyclic (1F1B) and their
    contents are tracked. Costs are per chunk pass (Fractions allowed).
    """
    return _Sim(schedules, chunk_of, C, micro_batches, forward_cost, backward_cost, phased).run()


class _Sim:
    def __init__(self, schedules, chunk_of, C, M, forward_cost, backward_cost, phased):
        self.P, self.C, self.M, self.phased = len(schedules), C, M, phased
        self.costs = (Fraction(forward_cost), Fraction(backward_cost))
        self.chunk_of = chunk_of
        self.rank_of = {chunk_of(r, p): r for r in range(self.P) for p in range(C // self.P)}
        self.streams = [[cmd for step in sched for cmd in step] for sched in schedules]
        self.batched = [any(isinstance(c, ds.CommitP2P) for c in s) for s in self.streams]
        P = self.P
        self.pc, self.clock = [0] * P, [Fraction(0)] * P
        self.inputs = [{} for _ in range(P)]  # buffer -> (chunk, micro-batch) held
        self.outputs = [{} for _ in range(P)]
        self.grads = [{} for _ in range(P)]
        self.loads = [0] * P
        self.fwd_done, self.bwd_done = set(), set()
        self.turned, self.turned_grad = set(), set()  # hand-overs on one rank (the V's turn)
        self.queued = [[] for _ in range(P)]
        self.waiting = [None] * P  # the posted batch a rank is blocked on
        self.channels = defaultdict(lambda: (deque(), deque()))  # (src, dst) -> sends, recvs
        self.at_barrier = set()
        self.timeline, self.orders, self.messages = [], [[] for _ in range(P)], 0

    def fail(self, rank, msg):
        raise ScheduleError(f"rank {rank}, instruction {self.pc[rank]}: {msg}")

    def where(self, rank, cmd, table):
        """(chunk, micro-batch) an instruction works on, checked against the buffer's content."""
        phase = getattr(cmd, "phase", 0)
        chunk = self.chunk_of(rank, phase)
        held = table[rank].get(cmd.buffer_id)
        if self.phased:
            mb = cmd.buffer_id - phase * self.M
            if not 0 <= mb < self.M:
                self.fail(rank, f"{cmd}: buffer outside phase {phase}")
            if held is not None and held != (chunk, mb):
                self.fail(rank, f"{cmd}: buffer holds {held}, expected chunk {chunk} mb {mb}")
            return chunk, mb
        if held is None or held[0] != chunk:
            self.fail(rank, f"{cmd}: buffer holds {held}, expected data of chunk {chunk}")
        return held

    def post(self, rank, ops):
        for op in ops:
            op.posted = self.clock[rank]
            key = (rank, op.peer) if op.send else (op.peer, rank)
            sends, recvs = self.channels[key]
            (sends if op.send else recvs).append(op)
            while sends and recvs:
                s, r = sends.popleft(), recvs.popleft()
                kind, chunk, mb = r.label
                if s.label[:2] != (kind, chunk) or mb not in (None, s.label[2]):
                    raise ScheduleError(
                        f"ranks {s.rank} -> {r.rank}: send {s.label} met receive {r.label}"
                    )
                s.matched_at = r.matched_at = max(s.posted, r.posted)
                r.on_done(s.label)
                self.messages += 1
        self.waiting[rank] = list(ops)

    def comm(self, rank, cmd, send, kind, chunk, mb, peer_chunk, on_done=None):
        if peer_chunk not in self.rank_of:
            self.fail(rank, f"{cmd}: there is no chunk {peer_chunk}")
        producer = chunk if send else peer_chunk
        op = _Op(rank, send, self.rank_of[peer_chunk], (kind, producer, mb), on_done)
        if self.batched[rank]:
            self.queued[rank].append(op)
        else:
            self.post(rank, [op])

    def compute(self, rank, forward, chunk, mb):
        start = self.clock[rank]
        self.clock[rank] += self.costs[0 if forward else 1]
        self.timeline.append(Interval(rank, forward, chunk, mb, start, self.clock[rank]))
        self.orders[rank].append((forward, chunk, mb))

    def forward(self, rank, cmd):
        phase = getattr(cmd, "phase", 0)
        chunk = self.chunk_of(rank, phase)
        if chunk > 0 and self.rank_of[chunk - 1] == rank:  # the turn-around input
            mb = cmd.buffer_id - phase * self.M
            if (chunk, mb) not in self.turned:
                self.fail(rank, f"{cmd}: chunk {chunk - 1} has not run mb {mb} here")
        else:
            chunk, mb = self.where(rank, cmd, self.inputs)
            if self.inputs[rank].get(cmd.buffer_id) != (chunk, mb):
                self.fail(rank, f"{cmd}: no input (received or loaded) for chunk {chunk} mb {mb}")
        if (chunk, mb) in self.fwd_done:
            self.fail(rank, f"chunk {chunk} mb {mb} forwarded twice")
        if chunk == self.C - 1 and self.loads[rank] <= mb:
            self.fail(rank, f"loss of mb {mb} before its labels were loaded")
        self.compute(rank, True, chunk, mb)
        self.fwd_done.add((chunk, mb))
        self.outputs[rank][cmd.buffer_id] = (chunk, mb)
        if chunk + 1 < self.C and self.rank_of[chunk + 1] == rank:
            self.turned.add((chunk + 1, mb))

    def backward(self, rank, cmd):
        chunk, mb = self.where(rank, cmd, self.outputs)
        if (chunk, mb) not in self.fwd_done or (chunk, mb) in self.bwd_done:
            self.fail(rank, f"backward of chunk {chunk} mb {mb}: not forwarded, or done twice")
        if chunk < self.C - 1:
            if self.rank_of[chunk + 1] == rank:
                if (chunk, mb) not in self.turned_grad:
                    self.fail(rank, f"backward of chunk {chunk} mb {mb} before chunk {chunk + 1}'s")
            elif self.grads[rank].get(cmd.buffer_id) != (chunk, mb):
                self.fail(rank, f"backward of chunk {chunk} mb {mb} before its gradient arrived")
        self.compute(rank, False, chunk, mb)
        self.bwd_done.add((chunk, mb))
        if chunk > 0 and self.rank_of[chunk - 1] == rank:
            self.turned_grad.add((chunk - 1, mb))

    def step(self, rank) -> bool:
        """Advance ``rank`` by one instruction; False while it is blocked."""
        if self.waiting[rank] is not None:
            if any(op.matched_at is None for op in self.waiting[rank]):
                return False
            self.clock[rank] = max([self.clock[rank]] + [o.matched_at for o in self.waiting[rank]])
            self.waiting[rank] = None
            return True
        cmd = self.streams[rank][self.pc[rank]]
        if isinstance(cmd, ds.LoadMicroBatch):
            mb = self.loads[rank]
            self.loads[rank] += 1
            if self.rank_of[0] == rank:
                if self.phased and cmd.buffer_id != mb:
                    self.fail(rank, f"{cmd}: micro-batch {mb} belongs in buffer {mb}")
                self.inputs[rank][cmd.buffer_id] = (0, mb)
        elif isinstance(cmd, ds.ForwardPass):
            self.forward(rank, cmd)
        elif isinstance(cmd, ds.BackwardPass):
            self.backward(rank, cmd)
        elif isinstance(cmd, ds.SendActivation):
            chunk, mb = self.where(rank, cmd, self.outputs)
            if (chunk, mb) not in self.fwd_done:
                self.fail(rank, f"{cmd} before the forward")
            self.comm(rank, cmd, True, "act", chunk, mb, chunk + 1)
        elif isinstance(cmd, ds.RecvActivation):
            phase = getattr(cmd, "phase", 0)
            chunk = self.chunk_of(rank, phase)
            mb = cmd.buffer_id - phase * self.M if self.phased else None
            table, buf = self.inputs[rank], cmd.buffer_id

            def arrived(label, table=table, buf=buf, chunk=chunk):
                table[buf] = (chunk, label[2])

            self.comm(rank, cmd, False, "act", chunk, mb, chunk - 1, arrived)
        elif isinstance(cmd, ds.SendGrad):
            chunk, mb = self.where(rank, cmd, self.inputs)
            if (chunk, mb) not in self.bwd_done:
                self.fail(rank, f"{cmd} before the backward")
            self.comm(rank, cmd, True, "grad", chunk, mb, chunk - 1)
        elif isinstance(cmd, ds.RecvGrad):
            chunk, mb = self.where(rank, cmd, self.outputs)
            if (chunk, mb) not in self.fwd_done:
                self.fail(rank, f"{cmd} before the forward")
            table, buf = self.grads[rank], cmd.buffer_id

            def arrived(label, table=table, buf=buf, chunk=chunk):
                table[buf] = (chunk, label[2])

            self.comm(rank, cmd, False, "grad", chunk, mb, chunk + 1, arrived)
        elif isinstance(cmd, ds.CommitP2P):
            ops, self.queued[rank] = self.queued[rank], []
            if ops:
                self.post(rank, ops)
        elif isinstance(cmd, ds.ReduceTiedGrads):  # a collective: every rank must reach it
            self.at_barrier.add(rank)
            if len(self.at_barrier) < self.P:
                return False
            self.clock[rank] = max(self.clock)
        elif isinstance(cmd, ds.OptimizerStep):
            if self.pc[rank] != len(self.streams[rank]) - 1:
                self.fail(rank, "the optimizer step is not the last instruction")
            mine = [c for c in range(self.C) if self.rank_of[c] == rank]
            left = [(c, m) for c in mine for m in range(self.M) if (c, m) not in self.bwd_done]
            if left or self.queued[rank]:
                self.fail(rank, f"optimizer step before backward {left[:3]} or with p2p queued")
        self.pc[rank] += 1
        return True

    def busy(self, rank) -> bool:
        return self.waiting[rank] is not None or self.pc[rank] < len(self.streams[rank])

    def run(self) -> SimResult:
        P = self.P
        while any(self.busy(r) for r in range(P)):
            moved = False
            for rank in range(P):
                while self.busy(rank) and self.step(rank):
                    moved = True
            if not moved:
                stuck = {r: self.streams[r][self.pc[r]] for r in range(P) if self.busy(r)}
                pending = {
                    r: [o.label for o in self.waiting[r] if o.matched_at is None]
                    for r in range(P)
                    if self.waiting[r]
                }
                raise ScheduleError(f"deadlock: ranks at {stuck}, waiting for {pending}")
        expected = {(c, m) for c in range(self.C) for m in range(self.M)}
        if self.fwd_done != expected or self.bwd_done != expected:
            raise ScheduleError("not every (chunk, micro-batch) ran forward and backward")
        ideal = ideal_timeline(self.orders, self.C, *self.costs)
        return SimResult(P, self.C, self.M, self.timeline, ideal, self.messages, self.orders)


def ideal_timeline(orders, C, forward_cost=1, backward_cost=2) -> list[Interval]:
    """Each rank runs its passes in the given order, as soon as their inputs exist."""
    end: dict[tuple[bool, int, int], Fraction] = {}
    idx, clock = [0] * len(orders), [Fraction(0)] * len(orders)
    out = []
    while any(idx[r] < len(orders[r]) for r in range(len(orders))):
        moved = False
        for r, order in enumerate(orders):
            while idx[r] < len(order):
                fwd, chunk, mb = order[idx[r]]
                dep = (True, chunk - 1, mb) if fwd else (False, chunk + 1, mb)
                deps = [] if (fwd and chunk == 0) or (not fwd and chunk == C - 1) else [dep]
                if not fwd:
                    deps.append((True, chunk, mb))
                if any(d not in end for d in deps):
                    break
                start = max([clock[r]] + [end[d] for d in deps])
                clock[r] = start + (forward_cost if fwd else backward_cost)
                end[(fwd, chunk, mb)] = clock[r]
                out.append(Interval(r, fwd, chunk, mb, start, clock[r]))
                idx[r] += 1
                moved = True
        if not moved:
            raise ScheduleError("the per-rank orders wait on each other in a cycle")
    return out
