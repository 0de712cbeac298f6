"""The AttnRes GPT against the math of DESIGN.md section 2 (single process, fp32).

``naive_hidden`` recomputes the forward pass straight from the definitions, keeping every
sublayer output v_i and forming block sums b_n from scratch for each sublayer, with the model's
own submodules and the reference depth-attention op. The model's incremental DepthState
machinery must agree with it for every block size, including uneven last blocks.
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.model.sequence_context import sequence_context
from attnres_dist.ops import depth_attention_reference
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from tests.tiny_model import VOCAB, build, naive_sources, naive_sublayer, randomize_mixers


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)


def tokens(batch=2, seq=12, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def naive_hidden(model, toks):
    """Final-normed hidden states from the definitions (no DepthState)."""
    plan = model.plan
    size = plan.effective_block_size
    L = plan.num_sublayers
    v = [model.embedding(toks).sources()[0]]  # v_0
    for layer in model.layers:
        m = layer.layer
        ctx = sequence_context(m.config, v[0], layer.rotary_base)
        for sub in (0, 1):
            i = len(v)  # this sublayer's number (1-based)
            mixer = layer.attn_mixer if sub == 0 else layer.mlp_mixer
            sources = naive_sources(v, i, size)
            x = depth_attention_reference(mixer.query, sources, mixer.key_norm_weight)
            v.append(naive_sublayer(m, ctx, x, attention=sub == 0))
    n_blocks = -(-L // size)
    finals = [v[0]] + [sum(v[1 + n * size : 1 + (n + 1) * size]) for n in range(n_blocks)]
    mixer = model.final.mixer
    return model.final.final_norm(
        depth_attention_reference(mixer.query, finals, mixer.key_norm_weight)
    )


@pytest.mark.parametrize("num_layers, block_size", [(3, 1), (3, 2), (3, 4), (3, 6), (2, 3)])
def test_model_matches_naive_definition(num_layers, block_size):
    model = build("block", block_size, num_layers)
    randomize_mixers(model)
    toks = tokens()
    torch.testing.assert_close(
        model.hidden_states(toks), naive_hidden(model, toks), atol=1e-5, rtol=1e-5
    )


def test_block_size_one_is_full_attnres():
    full, block = build("full"), build("block", 1)
    block.load_state_dict(full.state_dict())
    randomize_mixers(full)
    randomize_mixers(block)
    toks = tokens()
    assert torch.equal(full(toks), block(toks))


@pytest.mark.parametrize("mode, block_size", [("full", 1), ("block", 2), ("block", 6)])
def test_zero_queries_give_baseline_logits(mode, block_size):
    """Uniform mixes are scaled sums of the sources, and the next op is a scale-free RMSNorm.

    The norms' eps is added to inputs of different scale (the mean of n sources is 1/n of
    their sum, and the tiny init keeps mean squares near 1e-5), so the property holds up to eps:
    with eps = 1e-12 the logits agree to 1e-4 (fp32).
    """
    eps = {"model.norm_eps": 1e-12}
    attnres, baseline = build(mode, block_size, **eps), build("baseline", **eps)
    missing, unexpected = attnres.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and all("mixer" in k for k in missing)
    toks = tokens()
    torch.testing.assert_close(attnres(toks), baseline(toks), atol=1e-4, rtol=1e-4)


def test_step_zero_gradients():
    """Gains get exactly zero gradient; queries of mixes over >= 2 sources a non-zero one."""
    model = build("block", 2)
    model.loss(tokens(seq=13)).backward()
    params = dict(model.named_parameters())
    # the packed mixers [mixers, (query, key gain), D]: a layer's attention's and MLP's mixer
    grads = {
        **{f"layers.{i}.attn_mixer": params[f"layers.{i}.mixer_weights"].grad[0] for i in range(3)},
        **{f"layers.{i}.mlp_mixer": params[f"layers.{i}.mixer_weights"].grad[1] for i in range(3)},
        "final.mixer": params["final.mixer_weights"].grad[0],
    }
    for name, grad in grads.items():
        assert torch.count_nonzero(grad[1]) == 0, name  # the key gain
    assert torch.count_nonzero(grads["layers.0.attn_mixer"][0]) == 0  # one source: b_0
    for name in ("layers.0.mlp_mixer", "layers.1.attn_mixer", "layers.2.mlp_mixer", "final.mixer"):
        assert grads[name][0].abs().sum() > 0, name


def test_packed_mixers_are_the_only_mixer_parameters_and_not_decayed():
    """Each layer holds its two mixers as one ``[2, 2, D]`` tensor (zero queries, unit gains)
    and the final aggregation its one as ``[1, 2, D]``; AdamW decays none of them (gains and
    queries, like the norms' gains), and every matrix still is."""
    from attnres_dist.optim import param_groups

    model = build("block", 2)
    params = dict(model.named_parameters())
    packed = {n: p for n, p in params.items() if "mixer" in n}
    assert sorted(packed) == [
        "final.mixer_weights",
        *(f"layers.{i}.mixer_weights" for i in range(3)),
    ]
    for name, p in packed.items():
        assert p.shape == ((1 if name.startswith("final") else 2), 2, 32), name
        assert torch.equal(p[:, 0], torch.zeros_like(p[:, 0])), name
        assert torch.equal(p[:, 1], torch.ones_like(p[:, 1])), name
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    undecayed = {id(p) for p in no_decay["params"]}
    assert all(id(p) in undecayed for p in packed.values())
    matrices = [n for n, p in params.items() if p.dim() == 2]
    assert matrices and not any(id(params[n]) in undecayed for n in matrices)


def test_no_state_leaks_between_calls_and_modes():
    model = build("block", 3)
    randomize_mixers(model)
    a, b = tokens(seed=1), tokens(seed=2)
    first = model(a).detach()
    model(b)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(a), first)
    model.train()
    model.loss(tokens(seq=13, seed=3)).backward()
    assert torch.equal(model(a).detach(), first)


def grads(model, window):
    model.zero_grad(set_to_none=True)
    model.loss(window).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute, interval", [("attnres", 1), ("full", 1), ("full", 2)])
def test_recompute_gives_identical_gradients(recompute, interval):
    window = tokens(seq=13)
    reference = build("block", 3)
    randomize_mixers(reference)
    expected = grads(reference, window)
    model = build(
        "block", 3, **{"parallel.recompute": recompute, "parallel.recompute_interval": interval}
    )
    model.load_state_dict(reference.state_dict())
    got = grads(model, window)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-6, msg=name)


def test_lean_and_reference_ops_agree_inside_the_model():
    window = tokens(seq=13)
    lean = build("full")
    randomize_mixers(lean)
    ref = build("full", **{"model.attnres.impl": "reference"})
    ref.load_state_dict(lean.state_dict())
    expected, got = grads(ref, window), grads(lean, window)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_attnres_recompute_saves_less_for_backward():
    """recompute=attnres keeps no mix for backward: fewer saved bytes than none."""
    from bench.saved_bytes import SavedTensorCounter

    window = tokens(batch=4, seq=65)
    saved = {}
    for mode in ("none", "attnres"):
        model = build("full", num_layers=3, **{"parallel.recompute": mode, "model.seq_length": 64})
        with SavedTensorCounter() as counter:
            loss = model.loss(window)
        saved[mode] = counter.total_bytes()
        loss.backward()
    assert saved["attnres"] < saved["none"]


def test_single_rank_loss_equals_megatrons_vocab_parallel_cross_entropy():
    from megatron.core import tensor_parallel

    from attnres_dist.model.embedding_head import lm_loss

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(12, 2, 384, generator=g)).requires_grad_()
    labels = torch.randint(0, 384, (2, 12), generator=g)
    loss = lm_loss(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    ref = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).mean()
    (ref_grad,) = torch.autograd.grad(ref, logits)
    assert abs(loss.item() - ref.item()) <= 1e-6
    assert (grad - ref_grad).abs().max().item() <= 1e-7
