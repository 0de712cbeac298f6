"""Mixture-of-experts layers against their definition, in one process.

The MoE sublayer the trainer builds (Megatron-Core's router, dispatcher, SequentialMLP experts
and shared expert, wired by ``model/moe.py``) is checked against a float64 definition written
here from the papers, not from Megatron's code: top-k routing with the softmax over the chosen
logits (Mixtral), each expert a SwiGLU MLP, the shared expert added; the load-balancing loss
``E * sum_i f_i P_i`` (Switch Transformer, f over the top-k assignments) and the z-loss
``mean(logsumexp(logits)^2)`` (ST-MoE) reaching the router's gradient, scaled by
``set_aux_loss_scale``. Also: every expert-parallel layout draws the same experts, the
routing statistics count a forward once under recompute, and capacity drops are counted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnres_dist.config import load_config
from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
from attnres_dist.model.moe import RoutingStats, is_moe, set_aux_loss_scale
from tests.test_hf_export import process_group  # noqa: F401

E, K, AUX, ZLOSS = 4, 2, 0.3, 0.05
MOE = {
    "model.moe.num_experts": E,
    "model.moe.top_k": K,
    "model.moe.dense_layers": 1,
    "model.moe.shared_expert_ffn_hidden_size": 48,
    "model.moe.expert_ffn_hidden_size": 40,
    "model.moe.aux_loss_coeff": AUX,
    "model.moe.z_loss_coeff": ZLOSS,
}


def build(**extra):
    base = {
        "model.num_layers": 3,
        "model.hidden_size": 32,
        "model.num_attention_heads": 4,
        "model.seq_length": 16,
        **MOE,
        **extra,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in base.items()])
    return AttnResGPT(ModelBuilder(cfg.model, 257, seed=3)), cfg.model


def swiglu(x, fc1, fc2):
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.T


def definition(mlp, x):
    """(output, load-balancing loss, z-loss) of an MoE MLP on tokens ``x`` [T, h], float64."""
    d = torch.float64
    logits = x @ mlp.router.weight.to(d).T
    top, chosen = logits.topk(K, dim=-1)
    gates = top.softmax(dim=-1)  # softmax over the chosen experts' logits
    out = torch.zeros_like(x)
    experts = mlp.experts.local_experts
    for t in range(x.shape[0]):
        for g, e in zip(gates[t], chosen[t], strict=True):
            fc1, fc2 = experts[int(e)].linear_fc1.weight, experts[int(e)].linear_fc2.weight
            out[t] += g * swiglu(x[t], fc1.to(d), fc2.to(d))
    shared = mlp.shared_experts
    out = out + swiglu(x, shared.linear_fc1.weight.to(d), shared.linear_fc2.weight.to(d))
    tokens = x.shape[0]
    f = torch.zeros(E, dtype=d).index_add_(0, chosen.flatten(), torch.ones(tokens * K, dtype=d))
    f = f / (tokens * K)
    p = logits.softmax(dim=-1).mean(0)
    balance = E * (f * p).sum()
    z = logits.logsumexp(dim=-1).square().mean()
    return out, balance, z


def test_layers_are_moe_where_configured(process_group):  # noqa: F811
    model, _ = build()
    assert [is_moe(layer.layer.mlp) for layer in model.layers] == [False, True, True]
    model, _ = build(**{"model.moe.pattern": "[1,0,1]"})
    assert [is_moe(layer.layer.mlp) for layer in model.layers] == [True, False, True]


@pytest.mark.parametrize("scale", [1, 4])
def test_moe_sublayer_and_router_losses_match_the_definition(process_group, scale):  # noqa: F811
    model, _ = build()
    mlp = model.layers[1].layer.mlp
    mlp.train()
    x = torch.randn(12, 1, 32, generator=torch.Generator().manual_seed(5))
    set_aux_loss_scale(scale, "cpu")
    try:
        out, bias = mlp(x)
        assert bias is None
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
        (out * cotangent).sum().backward()
    finally:
        set_aux_loss_scale(1, "cpu")
    ref = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters()}
    with torch.nn.utils.stateless._reparametrize_module(mlp, ref):
        want, balance, z = definition(mlp, x.double()[:, 0])
    ((want * cotangent.double()[:, 0]).sum() + (AUX * balance + ZLOSS * z) / scale).backward()
    torch.testing.assert_close(out.double()[:, 0], want.detach(), atol=1e-6, rtol=1e-5)
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[name].grad, atol=1e-6, rtol=1e-5, msg=name)


def test_every_expert_layout_draws_the_same_experts(process_group):  # noqa: F811
    """Expert g is drawn under its own seed: a rank holding experts 2 and 3 (ep rank 1 of 2)
    draws the single-process model's experts 2 and 3."""
    from attnres_dist.model.gpt import seeded
    from attnres_dist.model.moe import init_experts

    model, _ = build()
    mlp = model.layers[2].layer.mlp
    before = [
        (e.linear_fc1.weight.clone(), e.linear_fc2.weight.clone())
        for e in mlp.experts.local_experts
    ]
    shared = mlp.shared_experts.linear_fc1.weight.clone()
    mlp.experts.local_experts = mlp.experts.local_experts[:2]
    mlp.local_expert_indices = [2, 3]
    init_experts(mlp, lambda name: seeded(3, name), 2)
    for expert, (fc1, fc2) in zip(mlp.experts.local_experts, before[2:], strict=True):
        assert torch.equal(expert.linear_fc1.weight, fc1)
        assert torch.equal(expert.linear_fc2.weight, fc2)
    assert torch.equal(mlp.shared_experts.linear_fc1.weight, shared)
    assert not torch.equal(before[0][0], before[1][0])


def test_routing_statistics_count_a_recomputed_forward_once(process_group):  # noqa: F811
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    model, model_cfg = build()
    stats = RoutingStats(model, model_cfg)
    assert stats.moe_layers == [1, 2]
    mlp = model.layers[1].layer.mlp
    mlp.train()
    x = torch.randn(10, 2, 32, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda h: mlp(h)[0], x, use_reentrant=False)
    out.sum().backward()  # recomputes the forward inside backward
    tracked = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][1]
    with torch.no_grad():
        logits = x.detach().view(-1, 32) @ mlp.router.weight.T
        _, chosen = logits.topk(K, dim=-1)
    _, balance, _ = definition(mlp, x.detach().double().view(-1, 32))
    torch.testing.assert_close(tracked.double(), balance, atol=1e-6, rtol=1e-5)  # once
    values = stats.read()
    assert values["moe/layer1/dropped"] == 0.0
    counts = torch.bincount(chosen.flatten(), minlength=E).double()
    assert values["moe/layer1/expert_load_max"] == pytest.approx(float(counts.max() * E / 40))
    assert "moe/layer2/load_balancing_loss" not in values  # layer 2 did not run
    assert stats.read() == {}  # the window was reset


def test_capacity_drops_are_counted(process_group):  # noqa: F811
    model, model_cfg = build(**{"model.moe.capacity_factor": 0.5})
    stats = RoutingStats(model, model_cfg)
    mlp = model.layers[1].layer.mlp
    mlp.train()
    mlp(torch.randn(16, 2, 32))
    values = stats.read()
    # each expert takes at most half its fair share: half of all token-expert pairs or more drop
    assert values["moe/layer1/dropped"] >= 0.5
