"""The activation contract and the partition, with no process group."""

from __future__ import annotations

import pytest
import torch

from attnres_dist.config import load_config
from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.model.depth_state import DepthState
from attnres_dist.pipeline.contract import (
    PayloadError,
    boundary_specs,
    boundary_specs_for_config,
    format_specs,
    pack,
    unpack,
)
from attnres_dist.pipeline.naming import canonical_name
from attnres_dist.pipeline.partition import (
    compute_parts,
    describe_parts,
    layer_counts_uniform,
    parts_from_counts,
)


def state_after(plan: BlockPlan, layers: int, s=5, b=2, h=8, requires_grad=False):
    completed, partial = plan.state_after(2 * layers)
    tensors = [
        torch.randn(s, b, h).requires_grad_(requires_grad) for _ in range(completed + int(partial))
    ]
    blocks, last = (tensors[:-1], tensors[-1]) if partial else (tensors, None)
    store = torch.stack(blocks) if blocks else None
    return DepthState(store, last, layers), tensors


@pytest.mark.parametrize("mode, size", [("baseline", 1), ("full", 1), ("block", 3)])
def test_pack_unpack_round_trip_and_gradients(mode, size):
    plan = BlockPlan(4, mode, size)
    for layers in range(5):
        state, leaves = state_after(plan, layers, requires_grad=True)
        payload = pack(state)
        assert payload.shape == (plan.boundary_width(layers), 5, 2, 8)
        back = unpack(payload, plan, layers, "test boundary")
        assert back.layers_done == layers
        assert (back.partial is None) == (state.partial is None)
        for a, b in zip(back.sources(), leaves, strict=True):
            assert torch.equal(a, b)
        sum(t.sum() * (i + 1) for i, t in enumerate(back.sources())).backward()
        for i, leaf in enumerate(leaves):
            assert torch.equal(leaf.grad, torch.full_like(leaf, i + 1.0))


def test_payload_disagreeing_with_plan_names_the_boundary():
    plan = BlockPlan(4, "block", 3)
    wrong = torch.zeros(plan.boundary_width(2) + 1, 5, 2, 8)
    with pytest.raises(PayloadError, match=r"boundary into stage 1 \(after 2 layers\): received"):
        unpack(wrong, plan, 2, "boundary into stage 1 (after 2 layers)")
    with pytest.raises(PayloadError, match="puts 3 tensors"):
        unpack(torch.zeros(5, 2, 8), plan, 2, "b")


def test_partitions():
    assert layer_counts_uniform(10, 4) == [3, 3, 2, 2]
    assert parts_from_counts([2, 2]) == [0, 3, 7]  # [emb, L0, L1 | L2, L3, final, head]
    assert parts_from_counts([1, 2, 1]) == [0, 2, 4, 7]
    cfg = load_config(None, ["model.num_layers=6", "parallel.pp=3"])
    assert compute_parts(cfg.model, 3, "uniform", 384) == [0, 3, 5, 9]
    parts = compute_parts(cfg.model, 3, "parameters", 384)
    assert parts[0] == 0 and parts[-1] == 9 and len(parts) == 4
    assert describe_parts([0, 3, 5, 9], 6) == [
        "stage 0: embedding, layers 0-1",
        "stage 1: layers 2-3",
        "stage 2: layers 4-5, final aggregation, lm head + loss",
    ]


def test_boundary_specs_grow_with_depth():
    cfg = load_config(
        None,
        [
            "model.num_layers=8",
            "model.attnres.mode=full",
            "parallel.pp=4",
            "model.seq_length=64",
            "model.hidden_size=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
        ],
    )
    specs = boundary_specs_for_config(cfg, vocab_size=384)
    assert [s.layers_before for s in specs] == [2, 4, 6]
    assert [s.num_tensors for s in specs] == [5, 9, 13]  # full: v_0 .. v_{2j}
    assert all(s.bytes_forward == s.num_tensors * 64 * 2 * 32 * 4 for s in specs)
    assert "stage 0 -> 1 (after 2 layers)" in format_specs(specs)


def test_boundary_before_head_carries_the_hidden_state():
    plan = BlockPlan(2, "block", 2)
    (spec,) = boundary_specs(plan, [0, 4, 5], 16, 2, 8)  # final aggregation ends stage 0
    assert spec.kind == "hidden" and spec.shape == (16, 2, 8) and spec.num_tensors == 1


def test_canonical_names():
    assert canonical_name("tied_modules.embed.embedding.embedding.word_embeddings.weight", 4) == (
        "embedding.embedding.word_embeddings.weight"
    )
    assert canonical_name("3.block.mixer_weights", 4) == "layers.2.mixer_weights"
    assert canonical_name("5.final.mixer_weights", 4) == "final.mixer_weights"
    assert canonical_name("6.output.lm_head.weight", 4) == "output.lm_head.weight"
    with pytest.raises(ValueError):
        canonical_name("7.block.x", 4)
