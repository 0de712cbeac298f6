"""Tests for the depth-attention op: lean autograd function vs the plain reference.

Tolerances (checked on CPU, float32 compute):
- float32 inputs: output, weights and every gradient are asserted against the
  reference at atol = rtol = 1e-5. Observed max abs errors: output 1.2e-6,
  weights 2.7e-7, source grads 7.2e-7, gain grad 1.9e-6, query grad 1.5e-5 (it
  sums over all tokens; its relative error stays within 1e-5 of |value|).
- bfloat16 sources: compared with the float32 reference evaluated on the same
  bf16 values upcast. Output and source gradients are rounded to bf16 once, so
  they are asserted at atol = rtol = 1e-2 (observed max relative error 3.8e-3,
  i.e. one bf16 rounding, 2**-8); weights are float32 and asserted at 1e-5;
  query/gain gradients are float32 and asserted at atol = rtol = 1e-4
  (observed max relative error 2.3e-5).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from attnres_dist.ops import (
    DepthAttentionImpl,
    available_depth_attention_impls,
    depth_attention,
    depth_attention_reference,
    get_depth_attention,
    register_depth_attention,
)
from bench.saved_bytes import SavedTensorCounter

da_module = importlib.import_module("attnres_dist.ops.depth_attention")

SHAPES = [(5, 8), (7, 3, 16), (2, 4, 64)]
REFERENCE_PHASE2 = get_depth_attention("reference").phase2
NS = [1, 2, 3, 9, 17]


def make_inputs(n, shape, dtype=torch.float32, param_dtype=None, seed=0, requires_grad=True):
    """Random sources plus a non-zero query and gain (gain around 1)."""
    gen = torch.Generator().manual_seed(seed)
    dim = shape[-1]
    param_dtype = param_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
    sources = [
        (torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + j % 3))
        .to(dtype)
        .requires_grad_(requires_grad)
        for j in range(n)
    ]
    query = (torch.randn(dim, generator=gen, dtype=torch.float64) / dim**0.5).to(param_dtype)
    gain = (1 + 0.5 * torch.randn(dim, generator=gen, dtype=torch.float64)).to(param_dtype)
    return query.requires_grad_(requires_grad), sources, gain.requires_grad_(requires_grad)


def detached_copy(query, sources, gain, dtype=None):
    """Leaf copies (optionally upcast) that require grad, for an independent graph."""

    def leaf(t):
        return t.detach().to(dtype or t.dtype).requires_grad_(True)

    return leaf(query), [leaf(s) for s in sources], leaf(gain)


def run_with_grads(fn, query, sources, gain, grad_out, grad_w=None):
    out, weights = fn(query, sources, gain, return_weights=True)
    loss = (out.float() * grad_out.float()).sum()
    if grad_w is not None:
        loss = loss + (weights * grad_w).sum()
    grads = torch.autograd.grad(loss, [query, gain, *sources])
    return out, weights, grads


def assert_close_all(actual, expected, atol, rtol):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(
            a.float(), e.float(), atol=atol, rtol=rtol, msg=lambda m, i=i: f"[{i}] {m}"
        )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", NS)
def test_lean_matches_reference_fp32(n, shape):
    q, s, g = make_inputs(n, shape, seed=n)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out_l, w_l, grads_l = run_with_grads(depth_attention, q, s, g, grad_out)
    out_r, w_r, grads_r = run_with_grads(depth_attention_reference, q, s, g, grad_out)
    assert out_l.dtype == torch.float32 and w_l.dtype == torch.float32
    assert_close_all([out_l, w_l, *grads_l], [out_r, w_r, *grads_r], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", NS)
def test_lean_bf16_matches_fp32_reference_on_same_values(n, shape):
    q, s, g = make_inputs(n, shape, dtype=torch.bfloat16, seed=n)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    out_l, w_l, grads_l = run_with_grads(depth_attention, q, s, g, grad_out)
    q32, s32, g32 = detached_copy(q, s, g, dtype=torch.float32)
    out_r, w_r, grads_r = run_with_grads(depth_attention_reference, q32, s32, g32, grad_out)
    assert out_l.dtype == torch.bfloat16 and w_l.dtype == torch.float32
    assert all(gr.dtype == torch.bfloat16 for gr in grads_l[2:])
    assert grads_l[0].dtype == torch.float32 and grads_l[1].dtype == torch.float32
    torch.testing.assert_close(w_l, w_r, atol=1e-5, rtol=1e-5)
    assert_close_all(grads_l[:2], grads_r[:2], atol=1e-4, rtol=1e-4)
    assert_close_all([out_l, *grads_l[2:]], [out_r, *grads_r[2:]], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multiple_token_chunks_match_reference(monkeypatch, dtype):
    # A tiny budget forces many chunks, including a ragged last one.
    monkeypatch.setattr(da_module, "_CPU_CHUNK_BYTES", 3 * 4 * 16 * 5)
    shape = (7, 11, 16)
    q, s, g = make_inputs(3, shape, dtype=dtype)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grad_w = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(4))
    out_l, w_l, grads_l = run_with_grads(depth_attention, q, s, g, grad_out, grad_w)
    q32, s32, g32 = detached_copy(q, s, g, dtype=torch.float32)
    out_r, w_r, grads_r = run_with_grads(depth_attention_reference, q32, s32, g32, grad_out, grad_w)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close_all([out_l, w_l, *grads_l], [out_r, w_r, *grads_r], atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5)])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("return_weights", [False, True])
def test_gradcheck_float64(n, shape, return_weights):
    q, s, g = make_inputs(n, shape, dtype=torch.float64, seed=7)

    def fn(query, gain, *sources):
        return depth_attention(query, sources, gain, return_weights=return_weights)

    assert torch.autograd.gradcheck(fn, (q, g, *s), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_gradcheck_float64_partial_requires_grad():
    q, s, g = make_inputs(3, (2, 3, 5), dtype=torch.float64, seed=8)
    s[0].requires_grad_(False)
    g.requires_grad_(False)

    def fn(query, *grad_sources):
        return depth_attention(query, [s[0], *grad_sources], g, return_weights=True)

    assert torch.autograd.gradcheck(fn, (q, s[1], s[2]), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["lean", "reference"])
def test_zero_query_gives_uniform_weights_mean_output_and_zero_gain_grad(impl):
    n, shape = 4, (6, 16)
    _, s, g = make_inputs(n, shape, seed=3)
    q = torch.zeros(shape[-1], requires_grad=True)
    out, weights = get_depth_attention(impl)(q, s, g, return_weights=True)
    torch.testing.assert_close(weights, torch.full((n, 6), 1.0 / n))
    torch.testing.assert_close(out, torch.stack(s).mean(0), atol=1e-6, rtol=1e-6)
    grad_out = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    dq, dg = torch.autograd.grad((out * grad_out).sum(), [q, g])
    assert torch.count_nonzero(dg) == 0
    assert dq.abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_source_returns_it_unchanged(dtype):
    q, s, g = make_inputs(1, (5, 3, 8), dtype=dtype)
    out, weights = depth_attention(q, s, g, return_weights=True)
    assert out.dtype == dtype and torch.equal(out, s[0])
    assert torch.equal(weights, torch.ones(1, 5, 3))


@pytest.mark.parametrize("impl", ["lean", "reference"])
@pytest.mark.parametrize("shape", SHAPES)
def test_return_weights_shape_and_normalisation(impl, shape):
    n = 5
    q, s, g = make_inputs(n, shape)
    fn = get_depth_attention(impl)
    out, weights = fn(q, s, g, return_weights=True)
    assert out.shape == shape
    assert weights.shape == (n, *shape[:-1]) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(0), torch.ones(shape[:-1]))
    assert (weights >= 0).all()
    assert isinstance(fn(q, s, g), torch.Tensor)


def test_non_contiguous_sources():
    base = [torch.randn(16, 6, generator=torch.Generator().manual_seed(j)) for j in range(3)]
    s = [b.t().requires_grad_() for b in base]  # [6, 16], non-contiguous
    q, _, g = make_inputs(1, (6, 16))
    grad_out = torch.randn(6, 16)
    _, _, grads_l = run_with_grads(depth_attention, q, s, g, grad_out)
    _, _, grads_r = run_with_grads(depth_attention_reference, q, s, g, grad_out)
    assert_close_all(grads_l, grads_r, atol=1e-5, rtol=1e-5)


def test_expanded_grad_output():
    # out.sum() hands backward a stride-0 (expanded) gradient.
    q, s, g = make_inputs(3, (7, 3, 16))
    grads_l = torch.autograd.grad(depth_attention(q, s, g).sum(), [q, g, *s])
    grads_r = torch.autograd.grad(depth_attention_reference(q, s, g).sum(), [q, g, *s])
    assert_close_all(grads_l, grads_r, atol=1e-5, rtol=1e-5)


def test_only_some_inputs_require_grad():
    shape = (7, 3, 16)
    q, s, g = make_inputs(4, shape, requires_grad=False)
    s[1].requires_grad_(True)
    s[3].requires_grad_(True)
    grad_out = torch.randn(shape)
    out = depth_attention(q, s, g)
    assert out.requires_grad
    ds1, ds3 = torch.autograd.grad((out * grad_out).sum(), [s[1], s[3]])
    ref = depth_attention_reference(q, s, g)
    rs1, rs3 = torch.autograd.grad((ref * grad_out).sum(), [s[1], s[3]])
    assert_close_all([ds1, ds3], [rs1, rs3], atol=1e-5, rtol=1e-5)
    # Nothing requires grad: no graph is built.
    assert not depth_attention(q, [x.detach() for x in s], g).requires_grad


def test_weights_gradient_only():
    q, s, g = make_inputs(3, (4, 8))
    _, weights = depth_attention(q, s, g, return_weights=True)
    grads = torch.autograd.grad(weights[0].sum() + 2 * weights[2].sum(), [q, g, *s])
    q2, s2, g2 = detached_copy(q, s, g)
    _, weights_r = depth_attention_reference(q2, s2, g2, return_weights=True)
    grads_r = torch.autograd.grad(weights_r[0].sum() + 2 * weights_r[2].sum(), [q2, g2, *s2])
    assert_close_all(grads, grads_r, atol=1e-5, rtol=1e-5)


def test_saved_tensors_hold_no_stacked_copy():
    n, tokens, dim = 5, 64, 32
    q, s, g = make_inputs(n, (tokens, dim))
    with SavedTensorCounter() as counter:
        out = depth_attention(q, s, g)
    source_keys = {(str(x.device), x.untyped_storage().data_ptr()) for x in s}
    saved_keys = {t.storage_key for t in counter.saved}
    assert source_keys <= saved_keys, "sources themselves are saved, not copies"
    for t in counter.extra_tensors([q, g, *s]):
        assert t.numel < tokens * dim, f"extra saved tensor {t.shape} is source-sized"
    assert not any(t.numel == n * tokens * dim for t in counter.saved)
    stats_bytes = 3 * n * tokens * 4
    assert counter.extra_bytes([q, g, *s]) <= stats_bytes
    assert counter.total_bytes() == sum(x.untyped_storage().nbytes() for x in [q, g, *s]) + (
        counter.extra_bytes([q, g, *s])
    )
    del out

    with SavedTensorCounter() as ref_counter:
        ref = depth_attention_reference(q, s, g)
    assert ref_counter.extra_bytes([q, g, *s]) >= n * tokens * dim * 4
    del ref


@pytest.mark.parametrize("impl", ["lean", "reference"])
def test_validation_errors(impl):
    fn = get_depth_attention(impl)
    q, s, g = make_inputs(2, (4, 8), requires_grad=False)
    with pytest.raises(ValueError, match="at least one"):
        fn(q, [], g)
    with pytest.raises(ValueError, match="list or tuple"):
        fn(q, torch.stack(s), g)
    with pytest.raises(ValueError, match="same shape"):
        fn(q, [s[0], torch.randn(5, 8)], g)
    with pytest.raises(ValueError, match="same dtype"):
        fn(q, [s[0], s[1].double()], g)
    with pytest.raises(ValueError, match="query must have shape"):
        fn(torch.randn(7), s, g)
    with pytest.raises(ValueError, match="query must have shape"):
        fn(torch.randn(1, 8), s, g)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        fn(q, s, torch.randn(4))
    with pytest.raises(ValueError, match="floating point"):
        fn(q, [torch.ones(4, 8, dtype=torch.long)] * 2, g)
    with pytest.raises(ValueError, match="torch.Tensor"):
        fn(q, [s[0], None], g)


def test_registry():
    # the one-pass kernels serve phase 2 alone (over the empty phase 1)
    assert get_depth_attention("lean").phase2.__wrapped__ is depth_attention
    assert get_depth_attention("reference").phase2.__wrapped__ is depth_attention_reference
    assert get_depth_attention("lean").phase1 is None
    assert get_depth_attention().name == "lean"
    assert {"lean", "reference"} <= set(available_depth_attention_impls())
    with pytest.raises(ValueError, match="allowed:.*'lean'.*'reference'"):
        get_depth_attention("fused_cuda_missing")
    with pytest.raises(ValueError, match="already registered"):
        register_depth_attention(DepthAttentionImpl("lean", phase2=REFERENCE_PHASE2))
    with pytest.raises(ValueError, match="DepthAttentionImpl"):
        register_depth_attention(depth_attention_reference)


def test_registry_accepts_new_impl(monkeypatch):
    registry = dict(importlib.import_module("attnres_dist.ops")._REGISTRY)
    monkeypatch.setattr(importlib.import_module("attnres_dist.ops"), "_REGISTRY", registry)
    impl = DepthAttentionImpl("test_impl", phase2=REFERENCE_PHASE2)
    register_depth_attention(impl)
    assert get_depth_attention("test_impl") is impl


@pytest.mark.parametrize("impl", ["lean", "reference"])
def test_one_pass_phase2_reads_pieces_as_their_rows(impl):
    """A one-pass backend's phase 2 over the empty phase 1 takes its sources stacked or as
    pieces (the model's store and partial block, where they lie): the same output and
    gradients, which are the one-pass op's on the rows as a list."""
    gen = torch.Generator().manual_seed(3)
    store = torch.randn(3, 2, 5, 8, generator=gen, requires_grad=True)
    partial = torch.randn(1, 2, 5, 8, generator=gen, requires_grad=True)
    weights = torch.randn(2, 8, generator=gen, requires_grad=True)
    phase2 = get_depth_attention(impl).phase2
    out = phase2(None, None, (store, partial), weights)
    grads = torch.autograd.grad(out.square().sum(), (store, partial, weights))
    sources = [*store.unbind(0), partial[0]]
    want = depth_attention_reference(weights[0], sources, weights[1])
    want_grads = torch.autograd.grad(want.square().sum(), (store, partial, weights))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    stacked = phase2(None, None, torch.cat((store, partial)), weights)
    torch.testing.assert_close(stacked, out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one-pass kernel"):
        phase2(out, out.sum(-1), partial, weights)
