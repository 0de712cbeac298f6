"""One trainer layer against its reference semantics, the exported decoder layer.

``hf/modeling_attnres.py:AttnResDecoderLayer.forward`` states what one AttnRes layer computes
in a dozen lines: per sublayer, mix the sources, norm, sublayer, add to the partial block,
close the block where the plan says. ``AttnResLayer`` (Megatron's submodules, the two-phase
depth attention, the store) must compute the same. Each case feeds layer ``i`` of both a
random depth state of the shape the block plan gives after ``i`` layers (what a pipeline
stage starting there receives) and compares the output states and the input states'
gradients under one random cotangent. Weights are the trainer's, exported (the 1-D ones
randomised, so the depth attention is far from uniform).
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.hf.modeling_attnres import attention_mask_4d
from attnres_dist.model.depth_state import DepthState
from tests.test_hf_export import build, export, load_hf, process_group  # noqa: F401

TOL = 1e-5
CASES = {
    "baseline": {"model.attnres.mode": "baseline"},
    "full": {"model.attnres.mode": "full"},
    "block2": {"model.attnres.block_size": 2},
    "block3-uneven": {"model.attnres.block_size": 3},  # blocks of 3, 3, 2 over 8 sublayers
    "delta_full": {"model.attnres.mode": "delta_full"},
    "delta_block3-uneven": {"model.attnres.mode": "delta_block", "model.attnres.block_size": 3},
}
S, B = 16, 2


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(trainer model, exported HF model, case name)."""
    torch.manual_seed(0)
    model, model_cfg = build(CASES[request.param])
    hf = load_hf(export(model, model_cfg, tmp_path_factory.mktemp("hf")))
    return model, hf, request.param


def random_state(model, layer: int, generator: torch.Generator):
    """(completed [c, s, b, h] or None, partial [s, b, h] or None) after ``layer`` layers."""
    hidden = model.layers[0].layer.config.hidden_size
    if model.plan.mode == "baseline":
        return None, torch.randn(S, B, hidden, generator=generator)
    completed, has_partial = model.plan.state_after(2 * layer)
    store = torch.randn(completed, S, B, hidden, generator=generator)
    partial = torch.randn(S, B, hidden, generator=generator) if has_partial else None
    return store, partial


def hf_layer_inputs(hf):
    config = hf.config
    from attnres_dist.hf.modeling_attnres import rotary_cos_sin

    positions = torch.arange(S)[None].expand(B, S)
    cos, sin = rotary_cos_sin(config, positions, torch.float32)
    return cos, sin, attention_mask_4d(None, B, S, 0, torch.device("cpu"))


@pytest.mark.parametrize("layer", range(4))
def test_layer_equals_the_decoder_layer(pair, layer):
    model, hf, case = pair
    g = torch.Generator().manual_seed(11 + layer)
    store, partial = random_state(model, layer, g)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (store, partial)]
    hf_leaves = [t.clone().requires_grad_() if t is not None else None for t in (store, partial)]

    out = model.layers[layer](DepthState(leaves[0], leaves[1], layer))
    got_completed = [] if out.store is None else list(out.store.unbind(0))
    got = got_completed + ([out.partial] if out.partial is not None else [])

    to_hf = lambda t: t.transpose(0, 1)  # [s, b, h] -> [b, s, h]  # noqa: E731
    completed = [] if hf_leaves[0] is None else [to_hf(t) for t in hf_leaves[0].unbind(0)]
    hf_partial = None if hf_leaves[1] is None else to_hf(hf_leaves[1])
    ref_completed, ref_partial = hf.model.layers[layer](
        (completed, hf_partial), *hf_layer_inputs(hf), None
    )
    ref = [t.transpose(0, 1) for t in ref_completed]
    ref += [ref_partial.transpose(0, 1)] if ref_partial is not None else []

    assert len(got) == len(ref), (case, layer)
    assert (out.partial is None) == (ref_partial is None)
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() <= TOL, (case, layer)

    cotangents = [torch.randn(t.shape, generator=g) for t in ref]
    torch.autograd.backward(got, cotangents)
    torch.autograd.backward(ref, cotangents)
    for mine, theirs in zip(leaves, hf_leaves, strict=True):
        if mine is None:
            continue
        assert (mine.grad - theirs.grad).abs().max().item() <= TOL, (case, layer)
