"""Virtual layouts, the cross-stage cache plan and its check-config text, with no process group.

The plan's payloads are checked against a brute-force walk of the sublayers (which rank has
seen which block), its totals against the paper's formulas on layouts where their assumptions
hold exactly, and its cache lifetimes against the schedules' simulated pass orders.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from deepspeed.runtime.pipe import schedule as ds

from attnres_dist.config import load_config
from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.errors import ConfigError
from attnres_dist.pipeline.interleaved_schedule import InterleavedSchedule
from attnres_dist.pipeline.schedule_sim import simulate
from attnres_dist.pipeline.stage_cache_plan import (
    CachePlan,
    looped_cached_formula,
    naive_formula,
    vshape_cached_formula,
)
from attnres_dist.pipeline.virtual_layout import VirtualLayout, build_layout, chunk_rank
from attnres_dist.pipeline.virtual_report import format_virtual_plan


def model(num_layers, mode="block", block_size=2):
    m = load_config("configs/tiny.yaml").model
    attnres = dataclasses.replace(m.attnres, mode=mode, block_size=block_size)
    return dataclasses.replace(m, num_layers=num_layers, attnres=attnres)


def plan_for(m, P, V, placement, partition="uniform", keep_produced=True, s=4, b=2, h=8):
    layout = build_layout(m, P, V, placement, partition)
    return CachePlan(layout, m.block_plan(), s, b, h, keep_produced=keep_produced)


def brute_force(num_layers, mode, S, layers_per_chunk, rank_of, keep_produced):
    """Walk the sublayers; per transition: (completed, partial?, receiver lacks, local?)."""
    L = 2 * num_layers
    completed, partial = ([] if mode == "baseline" else [0]), mode == "baseline"
    has: dict[int, set[int]] = {}
    out, sub = [], 0
    for chunk, n in enumerate(layers_per_chunk):
        rank = rank_of(chunk)
        mine = has.setdefault(rank, set())
        if chunk > 0:
            local = rank_of(chunk - 1) == rank
            lacking = () if local else tuple(x for x in completed if x not in mine)
            out.append((tuple(completed), partial, lacking, local))
        mine.update(completed)  # what arrives (or was kept) is held for later chunks
        for _ in range(2 * n):
            sub += 1
            if mode == "baseline":
                continue
            closes = mode == "full" or sub % S == 0 or sub == L
            if closes:
                block = sub if mode == "full" else (sub - 1) // S + 1
                completed.append(block)
                partial = False
                if keep_produced:
                    mine.add(block)
            else:
                partial = True
    return out


CASES = [
    # (num_layers, mode, block size, P, V, placement, partition)
    (8, "block", 2, 2, 2, "looped", "uniform"),
    (8, "block", 3, 2, 2, "looped", "uniform"),  # blocks end inside chunks
    (12, "block", 5, 2, 3, "looped", [1, 3, 2, 2, 1, 3]),
    (9, "full", 1, 2, 3, "looped", "uniform"),
    (16, "block", 3, 4, 2, "looped", "uniform"),
    (13, "block", 4, 4, 3, "looped", "uniform"),
    (6, "baseline", 1, 2, 3, "looped", "uniform"),
    (8, "block", 3, 2, 2, "vshape", "uniform"),
    (10, "full", 1, 4, 2, "vshape", [2, 1, 1, 1, 1, 1, 1, 2]),
    (16, "block", 3, 4, 2, "vshape", "uniform"),
]


@pytest.mark.parametrize("keep_produced", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_plan_matches_a_brute_force_walk(case, keep_produced):
    n, mode, S, P, V, placement, partition = case
    plan = plan_for(model(n, mode, S), P, V, placement, partition, keep_produced)
    lay = plan.layout
    counts = [len(lay.layers_of(c)) for c in range(lay.C)]
    expected = brute_force(n, mode, S, counts, lay.rank_of, keep_produced)
    assert len(plan.transitions) == len(expected)
    for t, (completed, partial, lacking, local) in zip(plan.transitions, expected, strict=True):
        assert t.naive_blocks == completed, t.name
        assert t.partial == partial, t.name
        assert t.cached_blocks == lacking, t.name
        assert (t.kind == "local") == local
        if not local:
            assert t.shape(False) == (len(completed) + partial, 4, 2, 8)
            assert t.shape(True) == (len(lacking) + partial, 4, 2, 8)
        assert t.nbytes(True) == (0 if local else (len(lacking) + partial) * 4 * 2 * 8 * 4)


ALIGNED = [(P, V, per_chunk) for P in (2, 4) for V in (2, 3) for per_chunk in (1, 2)]


@pytest.mark.parametrize("P, V, per_chunk", ALIGNED)
@pytest.mark.parametrize("mode", ["block", "full"])
def test_looped_totals_are_the_papers_formulas(P, V, per_chunk, mode):
    C = P * V
    m = model(C * per_chunk, mode, 2)  # block size 2 sublayers = one block per layer
    n_p = per_chunk * (2 if mode == "full" else 1)  # blocks closed per chunk, cut on boundaries
    for keep in (True, False):
        plan = plan_for(m, P, V, "looped", keep_produced=keep)
        naive = sum(len(t.naive_blocks) - 1 for t in plan.transitions)  # b_0 aside, as the paper
        cached = sum(len([x for x in t.cached_blocks if x]) for t in plan.transitions)
        assert not any(t.partial for t in plan.transitions)
        assert naive == naive_formula(C, n_p) == C * (C - 1) // 2 * n_p
        paper = P * (P - 1) // 2 * n_p + (V - 1) * P * P * n_p  # DESIGN.md section 3
        assert cached == looped_cached_formula(P, V, n_p, keep)
        assert cached == (paper if not keep else paper - (V - 1) * P * n_p)
        # peak width: O(C) naive, O(P) cached (b_0 rides the first round)
        assert plan.peak_width(False) == (C - 1) * n_p + 1
        assert plan.peak_width(True) == ((P - 1) * n_p + 1 if keep else P * n_p)


@pytest.mark.parametrize("P, per_chunk", [(2, 1), (4, 1), (4, 2)])
def test_vshape_totals(P, per_chunk):
    C = 2 * P
    plan = plan_for(model(C * per_chunk), P, 2, "vshape")
    n_p = per_chunk
    naive = sum(len(t.naive_blocks) - 1 for t in plan.transitions if t.kind != "local")
    cached = sum(len([x for x in t.cached_blocks if x]) for t in plan.transitions)
    assert naive == naive_formula(C, n_p, local_turn_chunks=P) == 2 * P * (P - 1) * n_p
    assert cached == vshape_cached_formula(P, n_p) == 3 * P * (P - 1) // 2 * n_p
    assert [t.kind for t in plan.transitions].count("local") == 1


def test_hand_computed_example_p4_v2():
    # 8 layers, one block per layer, 8 chunks: blocks b1..b8, b_0 the embedding.
    plan = plan_for(model(8), 4, 2, "looped")
    assert [t.naive_k for t in plan.transitions] == [2, 3, 4, 5, 6, 7, 8]
    # rank 0 kept b0, b1 from chunk 0, so chunk 3 -> 4 carries b2, b3, b4; and so on
    assert [t.cached_blocks for t in plan.transitions] == [
        (0, 1),
        (0, 1, 2),
        (0, 1, 2, 3),
        (2, 3, 4),
        (3, 4, 5),
        (4, 5, 6),
        (5, 6, 7),
    ]
    per_block = 4 * 2 * 8 * 4
    assert plan.bytes_per_micro_batch(False) == 35 * per_block
    assert plan.bytes_per_micro_batch(True) == 21 * per_block


def test_phase_shapes_are_the_transitions_into_and_out_of_each_chunk():
    plan = plan_for(model(8), 4, 2, "looped")  # the hand-computed example above
    assert plan.phase_shapes(0) == [
        {"recv": None, "send": (2, 4, 2, 8)},
        {"recv": (3, 4, 2, 8), "send": (3, 4, 2, 8)},
    ]
    assert plan.phase_shapes(3, cached=False)[1] == {"recv": (8, 4, 2, 8), "send": None}
    v = plan_for(model(8), 4, 2, "vshape")
    assert v.phase_shapes(3) == [
        {"recv": (4, 4, 2, 8), "send": None},  # the turn stays on rank 3
        {"recv": None, "send": (2, 4, 2, 8)},
    ]


def test_cache_entries_and_gradient_injection_points():
    plan = plan_for(model(4), 2, 2, "looped")  # chunk c = layer c; rank 0: 0, 2; rank 1: 1, 3
    entries = {(e.rank, e.block): e for e in plan.entries}
    # rank 0 produced b0, b1 in chunk 0 and reads them in chunk 2
    assert entries[(0, 0)] == dataclasses.replace(entries[(0, 0)], source_chunk=0, received=False)
    assert entries[(0, 1)].consumers == (2,)
    # rank 1 received b0, b1 in chunk 1's input and closed b2 there; chunk 3 reads all three
    assert {b: (e.received, e.source_chunk) for (r, b), e in entries.items() if r == 1} == {
        0: (True, 1),
        1: (True, 1),
        2: (False, 1),
    }
    # b3 arrives at rank 0's chunk 2 but rank 0 has no later chunk: nothing to keep
    assert (0, 3) not in entries


@pytest.mark.parametrize(
    "placement, P, V, M", [("looped", 2, 2, 4), ("looped", 4, 3, 8), ("vshape", 4, 2, 8)]
)
def test_stashed_gradients_exist_before_injection_and_caches_drain(placement, P, V, M):
    plan = plan_for(model(P * V * 2, "block", 3), P, V, placement)
    if placement == "looped":
        scheds = [InterleavedSchedule(M, P, r, V) for r in range(P)]
        costs = (Fraction(1, V), Fraction(2, V))
    else:
        scheds = [ds.DualPipeVSchedule(M, P, r) for r in range(P)]
        costs = (Fraction(1, 2), Fraction(1))
    result = simulate(scheds, lambda r, p: plan.layout.chunk_at(r, p), P * V, M, *costs)
    for rank, order in enumerate(result.orders):
        pos = {op: i for i, op in enumerate(order)}
        for e in plan.entries_of(rank):
            for mb in range(M):
                inject = pos[(False, e.source_chunk, mb)]
                assert all(pos[(False, c, mb)] < inject for c in e.consumers)
                assert pos[(True, e.source_chunk, mb)] < min(
                    pos[(True, c, mb)] for c in e.consumers
                )
    # at least one micro-batch's entries are alive at once, at most all M of them
    for rank, peak in enumerate(plan.peak_cache(result.orders)):
        assert len(plan.entries_of(rank)) <= peak <= M * len(plan.entries_of(rank))


def test_peak_cache_by_hand():
    # P = 2, V = 2, M = 2, one layer per chunk. Megatron's order: rank 0 warms up with all
    # four forwards (2 entries per micro-batch, both alive: 4); rank 1 runs F1.0 F1.1 F3.0 B3.0
    # F3.1 B3.1 B1.0 B1.1 with 3 entries per micro-batch, both alive before B1.0: 6.
    plan = plan_for(model(4), 2, 2, "looped")
    result = simulate(
        [InterleavedSchedule(2, 2, r, 2) for r in range(2)], lambda r, p: 2 * p + r, 4, 2, 1, 2
    )
    assert result.orders[1] == [
        (True, 1, 0), (True, 1, 1), (True, 3, 0), (False, 3, 0),
        (True, 3, 1), (False, 3, 1), (False, 1, 0), (False, 1, 1),
    ]  # fmt: skip
    assert plan.peak_cache(result.orders) == [4, 6]


def test_layouts():
    P, V = 4, 2
    assert [chunk_rank("looped", P, V, c) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [chunk_rank("vshape", P, V, c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    lay = build_layout(model(8), P, V, "looped")
    assert lay.chunks_of(1) == [1, 5] and lay.phase_of(5) == 1 and lay.chunk_at(1, 1) == 5
    assert (lay.embedding_rank, lay.head_rank, lay.tied_ranks) == (0, 3, (0, 3))
    v = build_layout(model(8), P, V, "vshape")
    assert (v.embedding_rank, v.head_rank, v.tied_ranks) == (0, 0, (0,))
    assert v.chunks_of(0) == [0, 7] and v.is_local(3) and not v.is_local(4)
    untied = build_layout(dataclasses.replace(model(8), tie_embeddings=False), P, V, "looped")
    assert untied.tied_ranks == ()
    from deepspeed.runtime.utils import partition_balanced

    from attnres_dist.pipeline.partition import part_param_counts

    params = build_layout(model(12), 2, 2, "looped", "parameters", vocab_size=256)
    weights = part_param_counts(model(12), 256)
    assert list(params.parts) == partition_balanced(weights=weights, num_parts=4)
    assert all(len(params.layers_of(c)) >= 1 for c in range(4))


def test_layout_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"model\.num_layers: got 4; 8 pipeline chunks"):
        build_layout(model(4), 4, 2, "looped")  # configs/tiny.yaml cannot fill 8 chunks
    with pytest.raises(ConfigError, match=r"parallel\.partition: got \[4, 4\]; need 4"):
        build_layout(model(8), 2, 2, "looped", [4, 4])
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        build_layout(model(12), 2, 3, "vshape")


def test_a_chunk_holding_only_the_head_receives_the_hidden_state():
    # 3 layers over 4 chunks, the last one just the head: parts of [emb, l0, l1, l2, final, head]
    lay = VirtualLayout("looped", 2, 2, 3, (0, 2, 3, 5, 6))
    plan = CachePlan(lay, BlockPlan(3, "block", 2), 4, 2, 8)
    last = plan.transitions[-1]
    assert (last.kind, last.shape(False), last.shape(True)) == ("hidden", (4, 2, 8), (4, 2, 8))
    assert all(3 not in e.consumers for e in plan.entries)


def test_check_config_text():
    text = format_virtual_plan(plan_for(model(4), 2, 2, "looped"))
    lines = text.splitlines()
    assert lines[1] == "  rank 0: chunk 0 (embedding, layer 0); chunk 2 (layer 2)"
    assert (
        lines[2] == "  rank 1: chunk 1 (layer 1); chunk 3 (layer 3, final aggregation, head + loss)"
    )
    assert lines[3] == "  tied embedding: copies on rank 0 and rank 1"
    # [s, b, h] = [4, 2, 8] fp32 = 256 bytes per tensor
    assert (
        "| chunk 1 -> 2 (rank 1 -> 0) | 2 | b0..b2 | [3, 4, 2, 8] | 768 | b2 | [1, 4, 2, 8] | 256 |"
        in lines
    )
    assert (
        "per micro-batch, each way: naive 2,304 bytes, cached 1,024 bytes (44%); "
        "widest payload 4 -> 2 tensors"
    ) in lines
    v = format_virtual_plan(plan_for(model(8, "block", 3), 2, 2, "vshape"))
    assert "| chunk 1 -> 2 (rank 1 -> 1) | 4 | stays on the rank | - | 0 | - | - | 0 |" in v
    assert "tied embedding: one shared copy on rank 0" in v
    assert "| chunk 0 -> 1 (rank 0 -> 1) | 2 | b0..b1 + partial | [3, 4, 2, 8] |" in v
