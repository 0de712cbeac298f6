"""Interleaved 1F1B and DualPipeV instruction streams, run on all ranks with no process group.

The schedule simulator (``pipeline/schedule_sim.py``) executes every rank's DeepSpeed
instructions under blocking, first-in-first-out p2p with batched commits. DeepSpeed's own
``TrainSchedule`` and ``DualPipeVSchedule`` are the controls; bubbles are checked against the
closed forms of the unit-cost model (a chunk's backward costs twice its forward).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from deepspeed.runtime.pipe import schedule as ds

from attnres_dist.pipeline.interleaved_schedule import (
    InterleavedSchedule,
    check_interleaved,
    megatron_order,
)
from attnres_dist.pipeline.schedule_sim import ScheduleError, simulate

GRID = [(P, V, M) for P in (2, 4) for V in (2, 3) for M in (P, 2 * P, 3 * P)]


def looped(P):
    return lambda rank, phase: phase * P + rank


def vshape(P):
    return lambda rank, phase: rank if phase == 0 else 2 * P - 1 - rank


def run_interleaved(P, V, M, streams=None):
    scheds = streams or [InterleavedSchedule(M, P, r, V) for r in range(P)]
    # the whole model costs 1 forward and 2 backward per micro-batch and rank: 1/V per chunk
    return simulate(scheds, looped(P), P * V, M, Fraction(1, V), Fraction(2, V))


def run_dualpipev(P, M, streams=None):
    scheds = streams or [ds.DualPipeVSchedule(M, P, r) for r in range(P)]
    return simulate(scheds, vshape(P), 2 * P, M, Fraction(1, 2), Fraction(1))


def run_1f1b(P, M, streams=None):
    scheds = streams or [ds.TrainSchedule(M, P, r) for r in range(P)]
    return simulate(scheds, lambda rank, phase: rank, P, M, 1, 2, phased=False)


def streams_of(scheds):
    return [[list(step) for step in s] for s in scheds]


@pytest.mark.parametrize("P, V, M", GRID)
def test_interleaved_runs_deadlock_free_with_the_textbook_bubble(P, V, M):
    result = run_interleaved(P, V, M)
    # forward and gradient of every (chunk, micro-batch) cross each of the C - 1 hand-overs
    assert result.messages == 2 * (P * V - 1) * M
    # Unit costs: a rank's work is M (f + b); rank 0 waits (P - 1) chunk forwards for the
    # first backward and rank P - 1 drains (P - 1) chunk backwards after it, (P-1)(f+b)/V idle
    # in all: bubble = (P - 1) / (V M + P - 1), Megatron's interleaved formula.
    assert result.bubble == Fraction(P - 1, V * M + P - 1)
    # the commits are placed so that blocking communication adds no wait at these costs
    assert result.blocking_bubble == result.bubble


@pytest.mark.parametrize("forward, backward", [(1, 1), (1, 3), (3, 2)])
def test_interleaved_stays_correct_when_costs_differ_from_the_planned_ones(forward, backward):
    # commits are placed for backward = 2 forward; other costs may wait, never deadlock
    P, V, M = 4, 3, 8
    scheds = [InterleavedSchedule(M, P, r, V) for r in range(P)]
    result = simulate(scheds, looped(P), P * V, M, forward, backward)
    assert result.blocking_bubble >= result.bubble


@pytest.mark.parametrize("P, V, M, G", [(2, 2, 6, 4), (2, 3, 5, 3)])
def test_interleaved_with_larger_micro_batch_groups(P, V, M, G):
    # Megatron's microbatch_group_size_per_vp_stage G > P: groups of 4 + 2, or 3 + 2 (M % P
    # != 0); the second needs passes held back for a common commit time, at no cost here
    scheds = [InterleavedSchedule(M, P, r, V, group_size=G) for r in range(P)]
    result = simulate(scheds, looped(P), P * V, M, Fraction(1, V), Fraction(2, V))
    assert result.messages == 2 * (P * V - 1) * M
    assert result.blocking_bubble == result.bubble == Fraction(P - 1, V * M + P - 1)


@pytest.mark.parametrize("P, M", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 12)])
def test_1f1b_control_has_the_1f1b_bubble(P, M):
    result = run_1f1b(P, M)
    assert result.messages == 2 * (P - 1) * M
    assert result.bubble == result.blocking_bubble == Fraction(P - 1, M + P - 1)


@pytest.mark.parametrize("P, M", [(2, 4), (2, 6), (2, 8), (4, 8), (4, 12)])
def test_dualpipev_control_runs_and_sits_between_1f1b_and_interleaved(P, M):
    result = run_dualpipev(P, M)
    assert result.messages == 2 * (2 * P - 2) * M  # the turn on rank P - 1 is local
    assert result.blocking_bubble >= result.bubble
    # below 1F1B; equal to interleaved with V = 2 at P = 2: 1 / (2 M + 1)
    assert Fraction(P - 1, 2 * M + P - 1) <= result.bubble < Fraction(P - 1, M + P - 1)
    if P == 2:
        assert result.bubble == Fraction(1, 2 * M + 1)
    # idle time does not grow with the number of micro-batches (it is fill and drain only),
    # and is (4 P - 5) chunk forwards of 1/2 each (observed for this DeepSpeed version)
    more = run_dualpipev(P, M + P)
    assert more.makespan - 3 * (M + P) == result.makespan - 3 * M == Fraction(4 * P - 5, 2)


@pytest.mark.parametrize("P, V, M", [(2, 2, 4), (4, 3, 8), (4, 2, 12)])
def test_megatron_order_is_its_table_and_fifo_per_chunk(P, V, M):
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    table = get_schedule_table(M, V, P)
    for rank in range(P):
        order = megatron_order(P, V, M, rank)
        forwards = [(op.micro_batch, op.phase) for op in order if op.forward]
        assert forwards == table
        backwards = [(op.micro_batch, V - 1 - op.phase) for op in order if not op.forward]
        assert backwards == table  # backward runs the chunks in reverse, same micro-batches
        warmup = next(i for i, op in enumerate(order) if not op.forward) - 1
        assert warmup == min(2 * (P - rank - 1) + (V - 1) * P, M * V)


def test_interleaved_buffers_and_final_step():
    sched = InterleavedSchedule(4, 2, 1, 3)
    assert sched.num_pipe_buffers() == 12
    steps = list(sched)
    last = [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]
    assert [type(c) for c in steps[-1]][-3:] == last
    cmds = [c for step in steps for c in step]
    phases = {c.phase for c in cmds if isinstance(c, ds.ForwardPass)}
    assert phases == {0, 1, 2}
    assert sum(isinstance(c, ds.LoadMicroBatch) for c in cmds) == 4  # labels for chunk C - 1


def test_megatron_conditions():
    assert check_interleaved(4, 2, 8) == 4
    with pytest.raises(ValueError, match="M >= P"):
        check_interleaved(4, 2, 3)
    with pytest.raises(ValueError, match="last group of 2"):
        check_interleaved(4, 2, 6)
    with pytest.raises(ValueError, match="V >= 2"):
        InterleavedSchedule(4, 2, 0, 1)


# The simulator must reject broken streams, or the tests above prove nothing.


def test_simulator_catches_a_swapped_pair_of_messages():
    P, V, M = 2, 2, 4
    streams = streams_of([InterleavedSchedule(M, P, r, V) for r in range(P)])
    # rank 0's first commit that both sends an activation and a gradient to rank 1: swap them
    for step in streams[0]:
        sends = [i for i, c in enumerate(step) if isinstance(c, ds.SendActivation | ds.SendGrad)]
        kinds = {type(step[i]) for i in sends}
        if len(kinds) == 2:
            a, b = sends[0], sends[1]
            step[a], step[b] = step[b], step[a]
            break
    else:
        pytest.fail("no commit carries an activation and a gradient to the same peer")
    with pytest.raises(ScheduleError, match="met receive"):
        run_interleaved(P, V, M, streams)


def test_simulator_catches_a_deadlock():
    P, M = 2, 2
    streams = [[c for step in ds.TrainSchedule(M, P, r) for c in step] for r in range(P)]
    # rank 0 waits for the first gradient before sending the first activation
    send = next(i for i, c in enumerate(streams[0]) if isinstance(c, ds.SendActivation))
    recv = next(i for i, c in enumerate(streams[0]) if isinstance(c, ds.RecvGrad))
    streams[0].insert(recv, streams[0].pop(send))
    with pytest.raises(ScheduleError, match="deadlock"):
        run_1f1b(P, M, [[s] for s in streams])


def test_simulator_catches_a_pass_before_its_receive_is_committed():
    P, M = 2, 4
    flat = [c for step in ds.DualPipeVSchedule(M, P, 1) for c in step]
    flat.pop(next(i for i, c in enumerate(flat) if isinstance(c, ds.CommitP2P)))
    rank0 = list(ds.DualPipeVSchedule(M, P, 0))
    with pytest.raises(ScheduleError, match="no input"):
        run_dualpipev(P, M, [rank0, [flat]])


def test_simulator_catches_a_backward_without_its_gradient():
    P, V, M = 2, 2, 2
    streams = streams_of([InterleavedSchedule(M, P, r, V) for r in range(P)])
    for step in streams[0]:
        step[:] = [c for c in step if not isinstance(c, ds.RecvGrad)]
    with pytest.raises(ScheduleError):
        run_interleaved(P, V, M, streams)
