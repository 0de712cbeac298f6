"""Delta AttnRes (arXiv 2605.18855) against its definition, written out here in float64.

Each sublayer reads ``h = h~ + sum_i a_i v_i`` with ``a = softmax_i(w . RMSNorm_g(v_i))``:
``h~`` is the plain PreNorm residual stream (the embedding plus every sublayer output so far),
the sources ``v_i`` are the embedding and every earlier sublayer output (Delta Full) or the
embedding and the stream's increments between block boundaries (Delta Block; the stream is
never reset). The sublayer's output is added to ``h~``; the final norm reads ``h~``.

``naive_delta`` keeps ``h~`` as a running sum and takes each Delta Block source as the stream
at a boundary minus the stream at the boundary before, in float64, with a float64 copy of the
model's own Megatron submodules; ``upstream_delta_full`` is the released code's per-sublayer
form (the stacked sources through one einsum softmax, added to the stream). The trainer's
model (fp32, its state of completed blocks and a partial block, every CPU depth-attention
backend) must give their hidden states and gradients.
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.model.gpt import AttnResGPT
from attnres_dist.model.sequence_context import sequence_context
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from tests.tiny_model import VOCAB, build, naive_sublayer, randomize_mixers

IMPLS = ("lean", "reference", "twophase", "cpu_fused")
# (mode, block size): 3 layers = 6 sublayers; block size 4 leaves an uneven last block of 2
SHAPES = [("delta_full", 1), ("delta_block", 2), ("delta_block", 4), ("delta_block", 6)]
TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module", autouse=True)
def process_group():
    init_distributed(ParallelDims(), seed=0)


def tokens(batch=2, seq=12, seed=0):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def mix(query, gain, sources, eps):
    """sum_i softmax_i(<query, RMSNorm(v_i) * gain>) v_i, in the sources' precision."""
    v = torch.stack(sources)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gain
    weights = torch.softmax((keys * query).sum(-1), dim=0)
    return (weights.unsqueeze(-1) * v).sum(0)


def mixers(model):
    """(query, key gain, eps) of each sublayer's mixer, in order."""
    out = []
    for layer in model.layers:
        for m in (layer.attn_mixer, layer.mlp_mixer):
            out.append((m.query, m.key_norm_weight, m.eps))
    return out


def naive_delta(model, toks, block_size: int):
    """Final-normed hidden states from the definition: a running stream, sources appended as
    increments at block boundaries."""
    stream = model.embedding(toks).sources()[0]
    sources, at_boundary = [stream], stream
    total = 2 * len(model.layers)
    weights = iter(mixers(model))
    i = 0
    for layer in model.layers:
        ctx = sequence_context(layer.layer.config, stream, layer.rotary_base)
        for attention in (True, False):
            i += 1
            query, gain, eps = next(weights)
            h = stream + mix(query, gain, sources, eps)
            stream = stream + naive_sublayer(layer.layer, ctx, h, attention)
            if i % block_size == 0 or i == total:
                sources.append(stream - at_boundary)
                at_boundary = stream
    return model.final.final_norm(stream)


def upstream_delta_full(model, toks):
    """The released code's Delta (per-sublayer) form: ``partial_block + einsum(softmax(
    einsum(q, norm(V))), V)`` with ``V`` the stacked deltas, the stream called the partial
    block there, every sublayer output appended to the deltas."""
    partial_block = model.embedding(toks).sources()[0]
    deltas = [partial_block]
    weights = iter(mixers(model))
    for layer in model.layers:
        ctx = sequence_context(layer.layer.config, partial_block, layer.rotary_base)
        for attention in (True, False):
            query, gain, eps = next(weights)
            V = torch.stack(deltas, dim=0)
            K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * gain
            logits = torch.einsum("d, n s b d -> n s b", query, K)
            selected = torch.einsum("n s b, n s b d -> s b d", logits.softmax(dim=0), V)
            out = naive_sublayer(layer.layer, ctx, partial_block + selected, attention)
            deltas.append(out)
            partial_block = partial_block + out
    return model.final.final_norm(partial_block)


def against(definition, make, toks, cotangent):
    """(hidden, {name: grad}) of ``definition`` on a float64 model made by ``make``, and of
    the hidden states of a second one in fp32, under one cotangent."""
    results = []
    for m, fn in ((make().double(), definition), (make(), AttnResGPT.hidden_states)):
        hidden = fn(m, toks)
        (hidden * cotangent.to(hidden.dtype)).sum().backward()
        results.append((hidden, {n: p.grad for n, p in m.named_parameters()}))
    return results


def tiny(mode, block_size, impl):
    """A maker of the tiny model with random mixers (the same weights each call)."""

    def make():
        model = build(mode, block_size, 3, **{"model.attnres.impl": impl})
        randomize_mixers(model)
        return model

    return make


def assert_same(reference, got):
    (h_ref, g_ref), (h, g) = reference, got
    torch.testing.assert_close(h, h_ref.float(), **TOL)
    assert g.keys() == g_ref.keys()
    for name in g:
        scale = g_ref[name].abs().max().clamp(min=1.0)
        torch.testing.assert_close(g[name] / scale, (g_ref[name] / scale).float(), **TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode, block_size", SHAPES)
def test_delta_matches_its_float64_definition(mode, block_size, impl):
    cotangent = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(3))
    size = 1 if mode == "delta_full" else block_size
    definition = lambda m, t: naive_delta(m, t, size)  # noqa: E731
    assert_same(*against(definition, tiny(mode, block_size, impl), tokens(), cotangent))


@pytest.mark.parametrize("impl", ("reference", "twophase"))
def test_delta_full_matches_the_released_per_sublayer_form(impl):
    cotangent = torch.randn(12, 2, 32, generator=torch.Generator().manual_seed(4))
    make = tiny("delta_full", 1, impl)
    assert_same(*against(upstream_delta_full, make, tokens(), cotangent))


def test_delta_block_size_one_is_delta_full():
    full, block = build("delta_full", 1), build("delta_block", 1)
    block.load_state_dict(full.state_dict())
    randomize_mixers(full)
    randomize_mixers(block)
    toks = tokens()
    assert torch.equal(full(toks), block(toks))


def test_delta_has_no_final_mix_and_two_vectors_per_sublayer():
    delta, block = build("delta_block", 2), build("block", 2)
    names = {n for n, _ in delta.named_parameters()}
    assert names == {n for n, _ in block.named_parameters()} - {"final.mixer_weights"}
    shapes = {delta.state_dict()[f"layers.{i}.mixer_weights"].shape for i in range(3)}
    assert shapes == {(2, 2, 32)}  # (attention, MLP) x (query, key gain) x hidden


def test_zero_queries_give_baseline_logits_with_scaled_eps():
    """Delta Full at zero queries reads ``(1 + 1/n) h~`` before each PreNorm; with each norm's
    eps scaled by ``(1 + 1/n)^2`` (``source_scaled_eps``) the logits are the baseline's."""
    scaled = {"model.attnres.source_scaled_eps": "true"}
    delta, baseline = build("delta_full", 1, **scaled), build("baseline")
    missing, unexpected = delta.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and all("mixer" in k for k in missing)
    toks = tokens()
    torch.testing.assert_close(delta(toks), baseline(toks), atol=2e-6, rtol=2e-6)
