"""The profiler's virtual-stage side without processes: transitions, bubbles, the report text.

Expected values come from the closed forms (the textbook bubbles of 1F1B, interleaved 1F1B and
DualPipeV at P = 2) and from hand-made records; the run itself is in test_profile.py.
"""

from __future__ import annotations

import pytest

from attnres_dist.config import load_config
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.pipeline.virtual_report import plan_for_config
from attnres_dist.profile import virtual

TINY = "configs/tiny.yaml"


@pytest.mark.parametrize("P, M", [(2, 4), (4, 8)])
def test_theoretical_bubbles_are_the_closed_forms(P, M):
    assert virtual.theoretical_bubble("1f1b", P, 1, M) == pytest.approx((P - 1) / (M + P - 1))
    for V in (2, 3):
        expected = (P - 1) / (V * M + P - 1)  # Megatron's interleaved formula
        assert virtual.theoretical_bubble("interleaved", P, V, M) == pytest.approx(expected)
    if P == 2:
        assert virtual.theoretical_bubble("dualpipev", P, 2, M) == pytest.approx(1 / (2 * M + 1))


def test_measured_bubble_by_hand():
    def ev(rank, kind, start, end, step=0):
        return {"rank": rank, "kind": kind, "step": step, "start": start, "end": end}

    # two ranks, span 0..4: rank 0 busy 3, rank 1 busy 2 -> 1 - 5 / 8; an optimizer event
    # outside the passes does not widen the span
    ranks = [
        {"rank": 0, "events": [ev(0, "forward", 0, 1), ev(0, "backward", 2, 4)]},
        {"rank": 1, "events": [ev(1, "forward", 1, 2), ev(1, "backward", 2, 3)]},
    ]
    ranks[0]["events"].append(ev(0, "optimizer", 4, 9))
    out = virtual.measured_bubble(ranks, ParallelDims(2, 1, 1))
    assert out["per_step"] == [pytest.approx(3 / 8)]
    assert virtual.pass_costs(ranks, ParallelDims(2, 1, 1)) == (1, pytest.approx(1.5))


def _cfg(*overrides):
    return load_config(
        TINY,
        [
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
            # micro-batches of 8: the byte counts below are for [s, b, h] = [128, 8, 128]
            "train.micro_batch_size=8",
            "train.global_batch_size=32",
            *overrides,
        ],
    )


def test_transition_rows_compare_every_transfer_with_the_plan():
    cfg = _cfg()
    plan = plan_for_config(cfg, 256)
    specs = virtual.transition_specs(plan, cached=True)
    assert [s["predicted_bytes"] for s in specs] == [2 * 524288, 524288, 524288]
    assert [s["naive_bytes"] for s in specs] == [2 * 524288, 3 * 524288, 4 * 524288]

    def tr(rank, op, direction, chunk, mb, nbytes):
        return {"rank": rank, "op": op, "direction": direction, "chunk": chunk, "step": 0,
                "micro_batch": mb, "nbytes": nbytes, "shapes": [[nbytes // 524288, 128, 8, 128]],
                "start": 0.0, "end": 0.1}  # fmt: skip

    transfers = {0: [], 1: []}
    for s in specs:
        for mb in range(4):
            n = s["predicted_bytes"]
            transfers[s["src_rank"]] += [
                tr(s["src_rank"], "send", "forward", s["src_chunk"], mb, n)
            ]
            transfers[s["dst_rank"]] += [
                tr(s["dst_rank"], "recv", "forward", s["src_chunk"], mb, n)
            ]
            transfers[s["dst_rank"]] += [
                tr(s["dst_rank"], "send", "backward", s["src_chunk"], mb, n)
            ]
            transfers[s["src_rank"]] += [
                tr(s["src_rank"], "recv", "backward", s["src_chunk"], mb, n)
            ]
    # one gradient of chunk 2 -> 3 came back naive-sized: that row must say so
    bad = next(t for t in transfers[0] if t["chunk"] == 2 and t["direction"] == "backward")
    bad["nbytes"] = 4 * 524288
    ranks = [{"rank": r, "transfers": transfers[r]} for r in (0, 1)]
    rows = virtual.transition_rows(specs, ranks, ParallelDims(2, 1, 1), 4)
    assert [r["forward"]["bytes_equal"] for r in rows] == [True, True, True]
    assert [r["backward"]["bytes_equal"] for r in rows] == [True, True, False]
    assert rows[2]["backward"]["measured_bytes"] == [524288, 4 * 524288]
    assert all(r["forward"]["micro_batches_seen"] for r in rows)
    assert rows[0]["forward"]["per_step_each_end"] == [4]
    table = virtual.transition_table(rows)
    assert (
        "| chunk 1 -> 2 (rank 1 -> 0) | 2 | [3, 128, 8, 128] | 1,572,864 | [1, 128, 8, 128] "
        in table
    )
    assert table.splitlines()[-1].endswith("| NO |")


def test_expected_trace_bytes_count_both_directions():
    cfg = _cfg()
    specs = virtual.transition_specs(plan_for_config(cfg, 256), cached=False)
    # rank 0 sends chunk 0 -> 1 and 2 -> 3 activations and chunk 1 -> 2's gradient
    per_mb = 2 * 524288 + 4 * 524288 + 3 * 524288
    assert virtual.expected_trace_bytes(specs, 0, 4, 2) == {"send": per_mb * 8, "recv": per_mb * 8}


def test_mode_transitions_follow_the_cache_choice():
    cfg = _cfg("parallel.cross_stage_cache=false")
    modes = virtual.mode_transitions(cfg, 256, 4, cached=False)
    assert list(modes) == ["baseline", "full", "block (S=2)"]
    assert [r["num_tensors"] for r in modes["baseline"]] == [1, 1, 1]
    assert [r["num_tensors"] for r in modes["block (S=2)"]] == [2, 3, 4]  # naive: all blocks
    assert modes["full"][0]["label"] == "chunk 0->1"
    cached = virtual.mode_transitions(cfg, 256, 4, cached=True)  # what the boundary sends
    assert [r["num_tensors"] for r in cached["block (S=2)"]] == [2, 1, 1]
