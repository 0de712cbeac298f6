"""The fused phase-2 merge + RMSNorm (``attnres_dist.ops.cpu_two_phase.merge_rms_norm``)
against its definition written out in float64: the softmax over [completed blocks ++ the extra
sources] with RMS-normalised keys, then RMSNorm of the mix; values and the gradients of all six
inputs for one extra source (Block's two-way merge) and several (Full's general one); equality
with the two kernels composed; the extras' gradient added into a given buffer (``grad_into``);
the composition it falls back to; and the Block and Full models with and without it."""

from __future__ import annotations

import pytest
import torch

from attnres_dist.ops import cpu_two_phase, get_depth_attention
from attnres_dist.ops.cpu_rms_norm import CpuRMSNorm
from attnres_dist.ops.cpu_two_phase import phase2, requirement

pytestmark = pytest.mark.skipif(requirement() is not None, reason=f"{requirement()}")


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def definition(blocks, extra, query, key_gain, norm_weight, eps=1e-6, norm_eps=1e-5):
    """RMSNorm(sum_i softmax_i(<RMS(v_i) g, q>) v_i) over v = blocks ++ extra (float64)."""
    sources = torch.cat([blocks, extra])
    logits = (_rms(sources, eps) * key_gain * query).sum(-1)
    mixed = (torch.softmax(logits, 0)[..., None] * sources).sum(0)
    return _rms(mixed, norm_eps) * norm_weight


def _inputs(n: int, dim: int, seed: int, m: int = 1):
    gen = torch.Generator().manual_seed(seed)
    blocks = 2 * torch.randn(n, 6, 3, dim, generator=gen)
    extra = 2 * torch.randn(m, 6, 3, dim, generator=gen)
    query = 0.3 * torch.randn(dim, generator=gen)
    key_gain = 1 + 0.3 * torch.randn(dim, generator=gen)
    norm_weight = 1 + 0.3 * torch.randn(dim, generator=gen)
    grad = torch.randn(6, 3, dim, generator=gen)
    return blocks, extra, query, key_gain, norm_weight, grad


def _phase1(blocks, query, key_gain):
    weights = torch.stack((query, key_gain))[None]
    out1, lse = get_depth_attention("cpu_fused").phase1(blocks, weights)
    return out1[0].detach(), lse[0].detach()


def merge_rms_norm(out1, lse, extra, query, key_gain, norm_weight, **kw):
    """The fused op, its query and key gain given apart (packed here, on the graph)."""
    weights = torch.stack((query, key_gain))
    return cpu_two_phase.merge_rms_norm(out1, lse, extra, weights, norm_weight, **kw)


NAMES = ["out1", "lse", "extra", "query", "key_gain", "norm"]


@pytest.mark.parametrize(
    "n, m, dim",
    [(1, 1, 16), (3, 1, 72), (2, 1, 128), (9, 1, 5), (2, 2, 16), (3, 5, 72), (4, 7, 64)],
)
def test_values_and_all_gradients_match_the_definition(n, m, dim):
    blocks, extra, query, key_gain, norm_weight, grad = _inputs(n, dim, n * 100 + dim, m)
    out1, lse = _phase1(blocks, query, key_gain)
    leaves = [t.clone().requires_grad_() for t in (out1, lse, extra, query, key_gain, norm_weight)]
    y = merge_rms_norm(*leaves[:6], eps=1e-6, norm_eps=1e-5)
    got = torch.autograd.grad((y * grad).sum(), leaves)

    # float64: out1 / lse enter as the phase-1 mix and its log-sum-exp, i.e. through
    # a0 = exp(lse - LSE) with LSE = logsumexp(lse, le_1 .. le_m) -- the identity the merge
    # computes
    o1, l1, e, q, g, w = (t.detach().double().requires_grad_() for t in leaves)
    le = (_rms(e, 1e-6) * g * q).sum(-1)
    total = torch.logsumexp(torch.cat([l1[None], le]), 0)
    h = torch.exp(l1 - total)[..., None] * o1 + (torch.exp(le - total)[..., None] * e).sum(0)
    want = _rms(h, 1e-5) * w
    want_grads = torch.autograd.grad((want * grad.double()).sum(), [o1, l1, e, q, g, w])
    full = definition(blocks.double(), extra.double(), query.double(), key_gain.double(), w)
    assert (y.double() - full).abs().max() <= 1e-5 * full.abs().max()
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for name, a, b in zip(NAMES, got, want_grads, strict=True):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), name


@pytest.mark.parametrize("m, dim", [(1, 64), (1, 72), (3, 64), (6, 72)])
def test_equals_the_merge_and_the_norm_composed(m, dim):
    """Same per-token arithmetic as the two standalone kernels: values and gradients equal."""
    from attnres_dist.ops.cpu_rms_norm import rms_norm

    blocks, extra, query, key_gain, norm_weight, grad = _inputs(3, dim, 11 * m + dim, m)
    out1, lse = _phase1(blocks, query, key_gain)
    leaves = [t.clone().requires_grad_() for t in (out1, lse, extra, query, key_gain, norm_weight)]
    fused = merge_rms_norm(*leaves)
    weights = torch.stack(leaves[3:5])
    composed = rms_norm(phase2(*leaves[:3], weights), leaves[5], 1e-5)
    assert torch.equal(fused, composed)
    grads_f = torch.autograd.grad(fused, leaves, grad)
    grads_c = torch.autograd.grad(composed, leaves, grad)
    for name, a, b in zip(NAMES, grads_f, grads_c, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "write"])
def test_extra_gradient_is_added_into_the_given_buffer(accumulate):
    """add: the gradient lands on the buffer's values; write: the rows hold no value yet
    (NaN here), and are written in full."""
    blocks, extra, query, key_gain, norm_weight, grad = _inputs(3, 32, 7)
    out1, lse = _phase1(blocks, query, key_gain)
    e = extra.clone().requires_grad_()
    plain = torch.autograd.grad(
        (merge_rms_norm(out1, lse, e, query, key_gain, norm_weight) * grad).sum(), e
    )[0]
    buffer = torch.full((2, 6, 3, 32), 0.5)
    buffer[1] = 0.5 if accumulate else float("nan")
    y = merge_rms_norm(
        out1,
        lse,
        extra.clone().requires_grad_(),
        query,
        key_gain,
        norm_weight,
        grad_into=lambda: (buffer[1:2], accumulate),
    )
    (y * grad).sum().backward()
    expected = plain + 0.5 if accumulate else plain
    torch.testing.assert_close(buffer[1:2], expected, rtol=0, atol=1e-6)
    assert (buffer[0] == 0.5).all()


def test_other_dtypes_compose_the_merge_and_the_norm():
    blocks, extra, query, key_gain, norm_weight, _ = _inputs(2, 16, 3)
    out1, lse = _phase1(blocks, query, key_gain)
    y = phase2(
        out1.double(),
        lse.double(),
        extra.double(),
        torch.stack((query, key_gain)).double(),
        norm=(norm_weight.double(), 1e-5),
    )
    want = definition(
        blocks.double(), extra.double(), query.double(), key_gain.double(), norm_weight.double()
    )
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def _model(words: list[str]):
    from attnres_dist.config import load_config
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
    from attnres_dist.runtime import select_runtime

    cfg = load_config("configs/tiny.yaml", [*words, "model.seq_length=32"])
    return AttnResGPT(
        ModelBuilder(cfg.model, 257, seed=cfg.train.seed, runtime=select_runtime(cfg.runtime))
    )


@pytest.mark.parametrize("mode", ["block", "full"])
@pytest.mark.parametrize("recompute", ["none", "attnres"])
def test_model_with_the_fused_merge_equals_it_without(mode, recompute):
    """Block and Full AttnRes with trained (non-zero) queries: the model through the fused merge
    + norm and through the two ops gives the same loss and gradients (fp32), and the fused op
    is called."""
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    init_distributed(ParallelDims(), seed=0)
    words = [
        f"model.attnres.mode={mode}",
        "model.attnres.impl=cpu_fused",
        f"parallel.recompute={recompute}",
    ]
    models = [_model(words), _model(words)]
    gen = torch.Generator().manual_seed(1)
    for name, p in models[0].named_parameters():
        if name.endswith("mixer_weights"):  # the queries: [mixers, (query, key gain), D]
            p.data[:, 0].copy_(0.5 * torch.randn(p[:, 0].shape, generator=gen))
    models[1].load_state_dict(models[0].state_dict())
    import dataclasses

    calls = []
    fused = cpu_two_phase.merge_rms_norm

    def counted(*args, **kw):
        calls.append(1)
        return fused(*args, **kw)

    op = get_depth_attention("cpu_fused")
    unfused = dataclasses.replace(op, options=op.options - {"norm"})

    window = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    results = []
    for model, backend in zip(models, [op, unfused], strict=True):
        mixers = [model.final.mixer]
        mixers += [m for layer in model.layers for m in (layer.attn_mixer, layer.mlp_mixer)]
        for m in mixers:
            m._op = backend
        cpu_two_phase.merge_rms_norm = counted if backend is op else fused
        try:
            loss = model.loss(window)
        finally:
            cpu_two_phase.merge_rms_norm = fused
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert calls
    assert any(isinstance(m, CpuRMSNorm) for m in models[0].modules())
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-4, atol=1e-6, msg=name)
