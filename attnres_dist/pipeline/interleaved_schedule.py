"""Interleaved 1F1B as a DeepSpeed ``PipeSchedule``: Megatron-Core's order, DualPipeV's form.

Order. Each rank's sequence of forward and backward chunk passes is Megatron-Core's interleaved
1F1B, taken from its own pure helpers: ``get_pp_rank_microbatches`` gives the rank's warm-up
count (``2 (P - r - 1) + (V - 1) G`` forwards, G = micro-batches per virtual-stage group,
default P) and ``get_schedule_table`` the (micro-batch, model chunk) of every virtual
micro-batch. Then, as in ``forward_backward_pipelining_with_interleaving``: the warm-up
forwards, one forward and one backward per steady step (the backward of virtual micro-batch k
runs chunk ``V - 1 - table[k].chunk``), the cool-down backwards. A chunk's backward takes its
micro-batches first in, first out, as Megatron pops its ``input_tensors`` queue.

Form. Instructions are built the way ``DualPipeVSchedule`` builds them: every pass, send and
receive carries ``phase`` = the rank-local chunk index, the pipe buffer of (phase, micro-batch)
is ``phase * M + micro_batch``, and sends and receives only queue work that the next
``CommitP2P`` launches as one batch. Which commit a message travels in is decided for all
ranks at once (``plan_commits``): with unit costs (backward = 2 x forward) every pass gets its
start and end time, and a message is committed at the first time after its producer ends at
which neither of the two ranks is inside a pass. Both sides therefore commit it at the same
point of a global order of commit times, and within a commit both list a peer's messages in
the sender's order, so blocking batched p2p neither deadlocks (whatever the real costs) nor
pairs a receive with the wrong send (with P = 2 activations and gradients share one pair of
ranks); at the planned costs no commit waits on top of the data flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from deepspeed.runtime.pipe import schedule as ds


@dataclass(frozen=True)
class ChunkPass:
    """One forward or backward pass of one rank-local chunk for one micro-batch."""

    forward: bool
    phase: int
    micro_batch: int


class _Group:  # the two calls Megatron's helper makes on a process group
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _Communicator:
    """What ``get_pp_rank_microbatches`` reads from a ``P2PCommunicator``: no process group."""

    def __init__(self, P: int, rank: int, V: int):
        self.pp_group = _Group(P, rank)
        self.virtual_pipeline_model_parallel_size = V


def check_interleaved(P: int, V: int, M: int, group_size: int | None = None) -> int:
    """Megatron's own conditions for the interleaved schedule; returns the group size G."""
    G = P if group_size is None else group_size
    if P < 2 or V < 2:
        raise ValueError(f"interleaving needs P >= 2 ranks and V >= 2 chunks each, got {P}, {V}")
    if not P <= G <= M:
        raise ValueError(
            f"micro-batches per virtual-stage group must be in [P={P}, M={M}], got {G} "
            f"(M >= P micro-batches are needed)"
        )
    if 0 < M % G < P:
        raise ValueError(f"M={M} leaves a last group of {M % G} < P={P} micro-batches")
    return G


@lru_cache(maxsize=256)
def megatron_order(
    P: int, V: int, M: int, rank: int, group_size: int | None = None, forward_only: bool = False
):
    """Rank ``rank``'s chunk passes in Megatron-Core's interleaved 1F1B order.

    ``forward_only`` (evaluation): every forward in the schedule table's order, as Megatron's
    forward-only pass runs them; any M >= 1 (a group of P, or of M when M < P).
    """
    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )

    if forward_only:
        G = min(P if group_size is None else group_size, M)
        return tuple(ChunkPass(True, chunk, mb) for mb, chunk in get_schedule_table(M, V, G))
    G = check_interleaved(P, V, M, group_size)
    total, _, warmup, remaining = get_pp_rank_microbatches(
        M, V, G, forward_only=False, p2p_communicator=_Communicator(P, rank, V)
    )
    table = get_schedule_table(M, V, G)
    forwarded: list[list[int]] = [[] for _ in range(V)]  # Megatron's input_tensors queues
    order: list[ChunkPass] = []

    def forward(k):
        micro_batch, phase = table[k]
        forwarded[phase].append(micro_batch)
        order.append(ChunkPass(True, phase, micro_batch))

    def backward(k):
        phase = V - 1 - table[k][1]
        order.append(ChunkPass(False, phase, forwarded[phase].pop(0)))

    for k in range(warmup):
        forward(k)
    for k in range(remaining):
        forward(warmup + k)
        backward(k)
    for k in range(remaining, total):
        backward(k)
    return tuple(order)


def _producer(P: int, V: int, rank: int, op: ChunkPass) -> tuple[int, ChunkPass] | None:
    """The pass on another rank whose output ``op`` consumes, or None (data / loss / local)."""
    C, chunk = P * V, op.phase * P + rank
    if op.forward:
        if chunk == 0:
            return None
        prev = chunk - 1
        return prev % P, ChunkPass(True, prev // P, op.micro_batch)
    if chunk == C - 1:
        return None
    nxt = chunk + 1
    return nxt % P, ChunkPass(False, nxt // P, op.micro_batch)


def _inside(intervals, t) -> bool:
    """True if a pass of one rank runs across time ``t`` (so the rank cannot commit then)."""
    return any(start < t < end for start, end in intervals)


def _timeline(orders, P, V, costs, not_before):
    """Start and end of every pass, each rank in its order, as soon as its input exists."""
    times: list[dict[ChunkPass, tuple[int, int]]] = [{} for _ in range(P)]
    idx, clock = [0] * P, [0] * P
    while any(idx[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while idx[r] < len(orders[r]):
                op = orders[r][idx[r]]
                start = max(clock[r], not_before.get((r, op), 0))
                prod = _producer(P, V, r, op)
                if prod is not None:
                    if prod[1] not in times[prod[0]]:
                        break
                    start = max(start, times[prod[0]][prod[1]][1])
                clock[r] = start + costs[0 if op.forward else 1]
                times[r][op] = (start, clock[r])
                idx[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"interleaved orders for P={P}, V={V} wait in a cycle")
    return times


@lru_cache(maxsize=64)
def plan_commits(
    P: int, V: int, M: int, group_size: int | None = None, costs=(1, 2), forward_only=False
):
    """Each rank's passes with their times, and the commit time of every message.

    A message from pass a (rank i) to pass b (rank j) is committed at the first time after a
    ends at which neither rank is inside a pass, and no later than b starts; if no such time
    exists, b waits for it. With passes costing ``costs`` (forward, backward) every commit is
    then met at once by the peer, so blocking commits cost nothing on top of the data flow.
    Returns (orders, times, messages) with messages = [(tau, i, a index, j, b)].
    """
    orders = [megatron_order(P, V, M, r, group_size, forward_only) for r in range(P)]
    not_before: dict[tuple[int, ChunkPass], int] = {}
    while True:
        times = _timeline(orders, P, V, costs, not_before)
        busy = [list(times[r].values()) for r in range(P)]
        messages, delayed = [], False
        for j in range(P):
            for b in orders[j]:
                prod = _producer(P, V, j, b)
                if prod is None:
                    continue
                i, a = prod
                tau = times[i][a][1]
                while _inside(busy[i], tau) or _inside(busy[j], tau):
                    tau = min(e for s, e in busy[i] + busy[j] if s < tau < e)
                if tau > times[j][b][0]:
                    not_before[(j, b)] = tau
                    delayed = True
                messages.append((tau, i, orders[i].index(a), j, b))
        if not delayed:
            return orders, times, sorted(messages, key=lambda m: (m[0], m[1], m[2]))


class InterleavedSchedule(ds.PipeSchedule):
    """Interleaved 1F1B over V chunks per rank (chunk c on rank c mod P), as instructions.

    Rank 0 loads each micro-batch before chunk 0 and rank P - 1 loads it (for the labels) before
    chunk C - 1, as ``TrainSchedule`` does on its first and last stage. ``forward_only``
    (``eval_batch``): the forwards and their activations only, no optimizer step.
    """

    def __init__(
        self, micro_batches, stages, stage_id, virtual_stages, group_size=None, forward_only=False
    ):
        super().__init__(micro_batches, stages, stage_id)
        self.virtual_stages = virtual_stages
        self.group_size = group_size
        self.forward_only = forward_only
        if not forward_only:
            check_interleaved(stages, virtual_stages, micro_batches, group_size)

    def num_pipe_buffers(self):
        """One slot per (phase, micro-batch): ``phase * micro_batches + micro_batch``."""
        return self.virtual_stages * self.micro_batches

    def buffer(self, phase: int, micro_batch: int) -> int:
        return phase * self.micro_batches + micro_batch

    def steps(self):
        P, V, M, rank = self.stages, self.virtual_stages, self.micro_batches, self.stage_id
        C = P * V
        orders, times, messages = plan_commits(
            P, V, M, self.group_size, forward_only=self.forward_only
        )
        commits: dict[int, list] = {}  # commit time -> this rank's queued sends and receives
        for tau, i, a_index, j, b in messages:
            a = orders[i][a_index]
            if i == rank:
                buf = self.buffer(a.phase, a.micro_batch)
                cmd = ds.SendActivation if a.forward else ds.SendGrad
                commits.setdefault(tau, []).append(cmd(buf, phase=a.phase))
            if j == rank:
                buf = self.buffer(b.phase, b.micro_batch)
                cmd = ds.RecvActivation if b.forward else ds.RecvGrad
                commits.setdefault(tau, []).append(cmd(buf, phase=b.phase))
        pending = sorted(commits)

        def flush(until):
            cmds = []
            while pending and pending[0] <= until:
                cmds += commits[pending.pop(0)] + [ds.CommitP2P()]
            return cmds

        for op in orders[rank]:
            chunk, buf = op.phase * P + rank, self.buffer(op.phase, op.micro_batch)
            cmds = flush(times[rank][op][0])
            if op.forward:
                if chunk in (0, C - 1):
                    cmds.append(ds.LoadMicroBatch(buf))
                cmds.append(ds.ForwardPass(buf, phase=op.phase))
            else:
                cmds.append(ds.BackwardPass(buf, phase=op.phase))
            yield cmds
        tail = flush(float("inf"))
        if self.forward_only:
            yield tail
            return
        yield tail + [ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()]
