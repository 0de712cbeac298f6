"""The block plan against the definitions of DESIGN.md section 2, by brute force."""

import math
from fractions import Fraction

import pytest

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.errors import ConfigError


def brute_force(num_layers: int, size: int):
    """(sources per sublayer, final sources, widths per layer cut) straight from the definition."""
    L = 2 * num_layers
    completed, partial = 1, 0  # b_0; partial holds how many outputs are summed so far
    sources, widths = [], [1]
    for sublayer in range(1, L + 1):
        sources.append(completed + (1 if partial else 0))
        partial += 1
        if sublayer % size == 0 or sublayer == L:
            completed, partial = completed + 1, 0
        if sublayer % 2 == 0:
            widths.append(completed + (1 if partial else 0))
    return sources, completed + (1 if partial else 0), widths


CASES = [(n, s) for n in (1, 2, 3, 5, 8) for s in (1, 2, 3, 4, 5, 7) if s <= 2 * n]


@pytest.mark.parametrize("num_layers, size", CASES)
def test_block_plan_matches_definition(num_layers, size):
    plan = BlockPlan(num_layers, "block", size)
    sources, final, widths = brute_force(num_layers, size)
    assert [plan.num_sources(i) for i in range(1, 2 * num_layers + 1)] == sources
    assert plan.final_num_sources == final
    assert list(plan.widths) == widths
    assert plan.num_blocks == math.ceil(2 * num_layers / size)


def test_full_is_block_size_one():
    for n in (1, 3, 6):
        full, block = BlockPlan(n, "full"), BlockPlan(n, "block", 1)
        assert full.widths == block.widths
        assert [full.num_sources(i) for i in range(1, 2 * n + 1)] == list(range(1, 2 * n + 1))
        assert full.final_num_sources == 2 * n + 1


def test_block_size_L_is_one_block():
    plan = BlockPlan(3, "block", 6)
    assert plan.num_blocks == 1
    assert [plan.num_sources(i) for i in range(1, 7)] == [1, 2, 2, 2, 2, 2]
    assert plan.final_num_sources == 2  # embedding + the one block


def test_baseline_carries_one_tensor():
    plan = BlockPlan(4, "baseline")
    assert set(plan.widths) == {1}


def test_uneven_last_block_closes_at_the_end():
    plan = BlockPlan(2, "block", 3)  # sublayers 1-3, 4
    assert [plan.closes_block(i) for i in range(1, 5)] == [False, False, True, True]


@pytest.mark.parametrize(
    "args, field",
    [
        ((0, "block", 2), "model.num_layers"),
        ((2, "blocky", 2), "model.attnres.mode"),
        ((2, "block", 0), "model.attnres.block_size"),
        ((2, "block", 5), "model.attnres.block_size"),
    ],
)
def test_invalid_plans_name_the_field(args, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        BlockPlan(*args)


@pytest.mark.parametrize(
    ("mode", "twin", "size"), [("delta_full", "full", 1), ("delta_block", "block", 3)]
)
def test_delta_carries_its_twin_s_state_and_mixes_completed_blocks_only(mode, twin, size):
    """A Delta state is its replacement twin's (the same rows cross every cut); its mixes
    leave out the partial block; zero queries scale the stream by 1 + 1/n, not 1/n."""
    delta, other = BlockPlan(4, mode, size), BlockPlan(4, twin, size)
    assert delta.widths == other.widths and delta.delta and not other.delta
    assert not delta.has_final_mix and other.has_final_mix
    for sublayer in range(1, 9):
        assert delta.closes_block(sublayer) == other.closes_block(sublayer)
        completed, _ = other.state_after(sublayer - 1)
        assert delta.num_sources(sublayer) == completed
        assert delta.zero_query_scale(sublayer) == 1 + Fraction(1, completed)
        assert other.zero_query_scale(sublayer) == Fraction(1, other.num_sources(sublayer))
    assert delta.zero_query_scale(None) == 1
