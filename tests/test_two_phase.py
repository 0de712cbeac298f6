"""Every depth-attention implementation against the reference, and the two phases against the
naive definition written out here.

Tolerances (CPU, float32 compute; worst case over the grid, errors relative to the largest
magnitude of the expected tensor):
- float32: output and every gradient within 1e-6 of the reference (observed worst case over
  n in {1, 2, 3, 9, 17}: twophase 4.1e-7 output, 4.8e-7 source, 4.5e-7 query/gain gradients;
  lean 2.5e-7 / 4.0e-7 / 3.2e-7).
- bfloat16 sources, compared with the float32 reference on the same values upcast: output and
  source gradients are rounded to bf16 once (observed 3.3e-3 / 3.7e-3, one bf16 rounding, as
  the reference's own bf16 cast: asserted at 1e-2); query and gain gradients stay float32
  (observed 5.4e-7: asserted at 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.ops import (
    DepthAttentionImpl,
    depth_attention_reference,
    get_depth_attention,
    register_depth_attention,
    runnable_depth_attention_impls,
)
from bench.saved_bytes import SavedTensorCounter

REFERENCE_PHASE2 = get_depth_attention("reference").phase2
NS = [1, 2, 3, 9, 17]
RUNNABLE = [name for name, why in runnable_depth_attention_impls().items() if why is None]
TWO_PHASE = [name for name in RUNNABLE if get_depth_attention(name).two_phase]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    e = expected.double()
    return ((actual.double() - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def make(n, shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dim = shape[-1]
    sources = [
        (torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + j % 3)).to(dtype)
        for j in range(n)
    ]
    query = torch.randn(dim, generator=gen, dtype=torch.float64) / dim**0.5
    gain = 1 + 0.5 * torch.randn(dim, generator=gen, dtype=torch.float64)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)  # as backward sees it
    return sources, query.float(), gain.float(), grad


def value_and_grads(fn, sources, query, gain, grad, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in sources]
    q, g = query.detach().clone().requires_grad_(), gain.detach().clone().requires_grad_()
    out = fn(q, leaves, g)
    grads = torch.autograd.grad((out.float() * grad.float()).sum(), [q, g, *leaves])
    return out, grads


@pytest.mark.parametrize("impl", RUNNABLE)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_impl_matches_reference(impl, n, dtype):
    shape = (6, 3, 32)
    sources, query, gain, grad = make(n, shape, dtype, seed=n)
    out, grads = value_and_grads(get_depth_attention(impl), sources, query, gain, grad, dtype)
    ref, ref_grads = value_and_grads(
        depth_attention_reference, sources, query, gain, grad, torch.float32
    )
    assert out.dtype == dtype and all(gr.dtype == dtype for gr in grads[2:])
    if dtype == torch.float32:
        for a, e in zip([out, *grads], [ref, *ref_grads], strict=True):
            assert rel_err(a, e) <= 1e-6
    else:
        for a, e in zip([out, *grads[2:]], [ref, *ref_grads[2:]], strict=True):
            assert rel_err(a, e) <= 1e-2
        for a, e in zip(grads[:2], ref_grads[:2], strict=True):
            assert rel_err(a, e) <= 1e-4


def naive_mix(sources: list[torch.Tensor], query, gain, eps=1e-6):
    """Output and log-sum-exp of depth attention, straight from the definition (float64)."""
    v = torch.stack([s.double() for s in sources])
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gain.double()
    logits = (keys * query.double()).sum(-1)
    return (torch.softmax(logits, 0).unsqueeze(-1) * v).sum(0), torch.logsumexp(logits, 0)


# widths: 16; 13, not a multiple of the kernels' 8-float vectors; 500, whose 33 rows are more
# than cpu_fused copies into a per-token tile
@pytest.mark.parametrize("impl", TWO_PHASE)
@pytest.mark.parametrize(
    "n, s, dim",
    [(1, 1, 16), (2, 3, 16), (9, 4, 16), (17, 2, 16), (5, 8, 16), (3, 11, 16), (4, 3, 13),
     (33, 3, 500)],
)  # fmt: skip
def test_phase1_matches_naive_definition(impl, n, s, dim):
    op = get_depth_attention(impl)
    gen = torch.Generator().manual_seed(n * 10 + s)
    blocks = torch.randn(n, 5, 2, dim, generator=gen).requires_grad_()
    queries = (0.3 * torch.randn(s, dim, generator=gen)).requires_grad_()
    gains = (1 + 0.3 * torch.randn(s, dim, generator=gen)).requires_grad_()
    g_out, g_lse = torch.randn(s, 5, 2, dim, generator=gen), torch.randn(s, 5, 2, generator=gen)
    # [S, 2, D] weights, one leaf: its gradient is both
    weights = torch.stack((queries, gains), 1).detach().requires_grad_()
    out1, lse = op.phase1(blocks, weights)
    out1, lse = torch.stack(out1), torch.stack(lse)
    assert out1.shape == (s, 5, 2, dim) and lse.shape == (s, 5, 2)
    assert out1.dtype == lse.dtype == torch.float32
    loss = (out1 * g_out).sum() + (lse * g_lse).sum()
    grad_b, grad_w = torch.autograd.grad(loss, [blocks, weights])
    grads = (grad_b, grad_w[:, 0], grad_w[:, 1])

    b, q, g = (t.detach().double().requires_grad_() for t in (blocks, queries, gains))
    ref = [naive_mix(list(b), q[i], g[i]) for i in range(s)]
    ref_out, ref_lse = torch.stack([r[0] for r in ref]), torch.stack([r[1] for r in ref])
    loss = (ref_out * g_out.double()).sum() + (ref_lse * g_lse.double()).sum()
    ref_grads = torch.autograd.grad(loss, [b, q, g])
    # float32 rounding grows with the length of the dot products: both implementations are
    # ~1.6e-6 from the float64 definition at width 500
    tol = 1e-6 if dim <= 16 else 4e-6
    for a, e in zip([out1, lse, *grads], [ref_out, ref_lse, *ref_grads], strict=True):
        assert rel_err(a, e) <= tol


@pytest.mark.parametrize("impl", TWO_PHASE)
# S = 1, 2; 3; 4, 8: the C kernels take queries 2, 3 or 4 at a time
@pytest.mark.parametrize("n, s, dim", [(1, 1, 16), (3, 2, 13), (4, 3, 21), (9, 4, 16), (5, 8, 72)])
@pytest.mark.parametrize("used", ["all", "some"])
@pytest.mark.parametrize("tokens", [(5, 2), (37, 1)], ids=["10", "37"])
@pytest.mark.parametrize("first_norm", [False, True], ids=["", "first_norm"])
def test_phase1_per_query_outputs_match_naive_definition(impl, n, s, dim, used, tokens, first_norm):
    """Per-query parameters in (packed), per-query outputs out; "some": the loss reads the first
    query's output and the last one's log-sum-exp only, so the others get no gradient.
    37 tokens: more than one tile of the C kernels (8 or 16 tokens), the last one partial.
    first_norm: the first output is an RMSNorm (its own gain, eps 1e-5) of the first query's
    mix, and the gain gets its gradient too."""
    op = get_depth_attention(impl)
    if first_norm and "first_norm" not in op.options:
        pytest.skip(f"{impl} does not fuse the first sublayer's norm")
    gen = torch.Generator().manual_seed(n * 10 + s)
    blocks = torch.randn(n, *tokens, dim, generator=gen).requires_grad_()
    queries = [(0.3 * torch.randn(dim, generator=gen)).requires_grad_() for _ in range(s)]
    gains = [(1 + 0.3 * torch.randn(dim, generator=gen)).requires_grad_() for _ in range(s)]
    norm_gain = (1 + 0.3 * torch.randn(dim, generator=gen)).requires_grad_()
    g_out = torch.randn(s, *tokens, dim, generator=gen)
    g_lse = torch.randn(s, *tokens, generator=gen)
    if used == "some":
        g_out[1:] = 0
        g_lse[:-1] = 0
    kw = {"first_norm": (norm_gain, 1e-5)} if first_norm else {}
    weights = torch.stack([torch.stack(pair) for pair in zip(queries, gains, strict=True)])
    out1, lse = op.phase1(blocks, weights, **kw)
    assert len(out1) == len(lse) == s
    shapes = [(o.shape, x.shape) for o, x in zip(out1, lse, strict=True)]
    assert all(o == (*tokens, dim) and x == tokens for o, x in shapes)
    if used == "all":
        loss = sum((o * g).sum() for o, g in zip(out1, g_out, strict=True))
        loss = loss + sum((x * g).sum() for x, g in zip(lse, g_lse, strict=True))
    else:
        loss = (out1[0] * g_out[0]).sum() + (lse[-1] * g_lse[-1]).sum()
    leaves = [blocks, *queries, *gains, *([norm_gain] if first_norm else [])]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)

    b = blocks.detach().double().requires_grad_()
    q = [t.detach().double().requires_grad_() for t in queries]
    g = [t.detach().double().requires_grad_() for t in gains]
    w = norm_gain.detach().double().requires_grad_()
    ref = [naive_mix(list(b), q[i], g[i]) for i in range(s)]
    if first_norm:  # RMSNorm written out: x / sqrt(mean(x^2) + eps) * w
        x = ref[0][0]
        ref[0] = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w, ref[0][1])
    loss = sum((r[0] * go.double()).sum() + (r[1] * gl.double()).sum()
               for r, go, gl in zip(ref, g_out, g_lse, strict=True))  # fmt: skip
    ref_grads = torch.autograd.grad(loss, [b, *q, *g, *([w] if first_norm else [])])
    for a, e in zip([*out1, *lse], [*(r[0] for r in ref), *(r[1] for r in ref)], strict=True):
        assert rel_err(a, e) <= 2e-6
    for a, e in zip(grads, ref_grads, strict=True):
        a = torch.zeros_like(e) if a is None else a  # an unused query's: zero
        assert rel_err(a, e) <= 2e-6 if e.abs().max() > 0 else a.abs().max() == 0


@pytest.mark.parametrize("impl", TWO_PHASE)
@pytest.mark.parametrize("n, m", [(1, 1), (3, 1), (2, 2), (4, 3), (5, 4), (3, 5), (9, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_phase2_completes_the_one_pass_softmax(impl, n, m, dtype):
    op = get_depth_attention(impl)
    gen = torch.Generator().manual_seed(n * 10 + m)
    blocks = torch.randn(n, 5, 2, 16, generator=gen).to(dtype)
    extra = (2 * torch.randn(m, 5, 2, 16, generator=gen)).to(dtype).requires_grad_()
    query = (0.3 * torch.randn(16, generator=gen)).requires_grad_()
    gain = (1 + 0.3 * torch.randn(16, generator=gen)).requires_grad_()
    grad = torch.randn(5, 2, 16, generator=gen).to(dtype).float()  # as backward sees it
    out1, lse = op.phase1(blocks, torch.stack((query, gain)).detach()[None])
    out1, lse = out1[0].detach().requires_grad_(), lse[0].detach().requires_grad_()
    # [2, D] weights, one leaf: its gradient is both
    weights = torch.stack((query, gain)).detach().requires_grad_()
    out = op.phase2(out1, lse, extra, weights)
    grads = torch.autograd.grad((out.float() * grad).sum(), [out1, lse, extra, weights])
    grads = (*grads[:3], grads[3][0], grads[3][1])
    assert out.dtype == dtype

    # expected: the naive mix over blocks ++ extra; gradients of out1 and lse through the
    # identity out = a0 * out1 + ..., a0 = exp(lse - LSE) (float64 autograd)
    o1, l1 = out1.detach().double().requires_grad_(), lse.detach().double().requires_grad_()
    e, q, g = (t.detach().double().requires_grad_() for t in (extra, query, gain))
    ek = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    le = (ek * q).sum(-1)
    total = torch.logsumexp(torch.cat([l1[None], le]), 0)
    ref = torch.exp(l1 - total)[..., None] * o1 + (torch.exp(le - total)[..., None] * e).sum(0)
    ref_grads = torch.autograd.grad((ref * grad.double()).sum(), [o1, l1, e, q, g])
    full, _ = naive_mix([*blocks, *extra], query.detach(), gain.detach())
    tol_out = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(out, full) <= tol_out
    assert rel_err(out, ref) <= tol_out
    for i, (a, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert rel_err(a, r) <= (1e-6 if dtype == torch.float32 or i in (0, 1, 3, 4) else 1e-2)


def test_packed_weights_of_the_wrong_shape_are_refused():
    op = get_depth_attention("twophase")
    blocks, out1, lse = torch.randn(3, 4, 8), torch.randn(4, 8), torch.randn(4)
    extra = torch.randn(1, 4, 8)
    for bad in (torch.randn(2, 3, 8), torch.randn(2, 2, 7), torch.randn(2, 8)):
        with pytest.raises(ValueError, match=r"weights must have shape \[S, 2, D=8\]"):
            op.phase1(blocks, bad)
    for bad in (torch.randn(3, 8), torch.randn(2, 7), torch.randn(1, 2, 8)):
        with pytest.raises(ValueError, match=r"weights must have shape \[2, D=8\]"):
            op.phase2(out1, lse, extra, bad)


@pytest.mark.parametrize("impl", TWO_PHASE)
def test_phases_save_no_normalised_keys_or_products(impl):
    """Beyond their inputs the phases save per-token statistics only: no [T, D] tensor."""
    op = get_depth_attention(impl)
    n, s, tokens, dim = 6, 4, 64, 32
    blocks = torch.randn(n, tokens, dim).requires_grad_()
    weights = torch.stack((torch.randn(s, dim), torch.ones(s, dim)), 1).requires_grad_()
    partial = torch.randn(tokens, dim).requires_grad_()
    with SavedTensorCounter() as c1:
        out1, lse = op.phase1(blocks, weights)
    with SavedTensorCounter() as c2:
        out = op.phase2(out1[1], lse[1], partial[None], weights[1])
    # phase 1 may keep per token and block one key statistic and the S logits (S / D of the
    # blocks' size) and per token and query its log-sum-exp; phase 2 a few floats per token
    bounds = (4 * tokens * (n * (1 + s) + s), 4 * tokens * 2 * s)
    cases = ((c1, [blocks, weights]), (c2, [*out1, *lse, partial, weights[1]]))
    for (counter, inputs), bound in zip(cases, bounds, strict=True):
        extra = counter.extra_tensors(inputs)
        assert all(t.numel < tokens * dim for t in extra), extra
        assert counter.extra_bytes(inputs) <= bound
    del out


def test_auto_and_refusals(monkeypatch):
    from attnres_dist.errors import ConfigError
    from attnres_dist.ops import __dict__ as ops_ns
    from attnres_dist.ops.cpu_two_phase import requirement
    from attnres_dist.runtime.select import select_depth_attention

    expected = "cpu_fused" if requirement() is None else "twophase"
    assert select_depth_attention("auto", "cpu").value == expected
    assert select_depth_attention("lean", "cpu").value == "lean"
    with pytest.raises(ConfigError, match=r"model\.attnres\.impl: got 'fast'; allowed: auto, "):
        select_depth_attention("fast", "cpu")
    registry = dict(ops_ns["_REGISTRY"])
    monkeypatch.setattr("attnres_dist.ops._REGISTRY", registry)
    register_depth_attention(
        DepthAttentionImpl("needs_x", phase2=REFERENCE_PHASE2, requirement=lambda: "x missing")
    )
    with pytest.raises(ConfigError) as err:
        select_depth_attention("needs_x", "cpu")
    message = str(err.value)
    assert "'needs_x' cannot run here: x missing; available here: auto, " in message
    assert "lean" in message and "needs_x" not in message.split("available here:")[1]
    # without the C kernels (no compiler) auto takes the torch two-phase ops and says why
    register_depth_attention(
        DepthAttentionImpl("cpu_fused", phase2=REFERENCE_PHASE2, requirement=lambda: "no cc"),
        overwrite=True,
    )
    choice = select_depth_attention("auto", "cpu")
    assert choice.value == "twophase" and "cpu_fused: no cc" in choice.reason


@pytest.mark.parametrize(
    "runnable, expected",
    [({"fla", "triton"}, "fla"), ({"triton"}, "triton"), (set(), "twophase")],
)
def test_auto_on_cuda_prefers_fla_then_triton(monkeypatch, runnable, expected):
    """On a GPU auto takes fla-core's kernel where it is installed (measured as fast or faster
    than the project's on an H200, docs/gpu.md), else the project's Triton kernel, else the torch
    ops; the reason names what was missing."""
    from attnres_dist.ops import __dict__ as ops_ns
    from attnres_dist.runtime.select import select_depth_attention

    registry = dict(ops_ns["_REGISTRY"])
    monkeypatch.setattr("attnres_dist.ops._REGISTRY", registry)
    for name in ("fla", "triton"):
        why = None if name in runnable else f"{name} is not installed"
        impl = DepthAttentionImpl(name, phase2=REFERENCE_PHASE2, requirement=lambda w=why: w)
        register_depth_attention(impl, overwrite=True)
    choice = select_depth_attention("auto", "cuda")
    assert choice.value == expected
    missing = {"fla": None, "triton": "fla", "twophase": "triton"}[expected]
    if missing:
        assert f"{missing} is not installed" in choice.reason, choice.reason


def test_fused_cpu_kernels_refused_without_a_compiler(monkeypatch, tmp_path):
    """No working compiler: cpu_fused says why, naming it; auto falls back to the torch ops."""
    from attnres_dist.errors import ConfigError
    from attnres_dist.ops import cpu_library, cpu_two_phase
    from attnres_dist.runtime.select import select_depth_attention

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ATTNRES_DIST_KERNEL_CACHE", str(tmp_path / "kernels"))
    cpu_library._library.cache_clear()
    try:
        reason = cpu_two_phase.requirement()
        assert reason is not None and "no-such-cc" in reason and "set CC" in reason
        with pytest.raises(ConfigError, match=r"model\.attnres\.impl: 'cpu_fused' cannot run"):
            select_depth_attention("cpu_fused", "cpu")
        assert select_depth_attention("auto", "cpu").value == "twophase"
    finally:
        monkeypatch.undo()
        cpu_library._library.cache_clear()
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").iterdir())
