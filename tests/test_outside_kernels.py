"""Outside AttnRes kernels (fla-core, flash-attn-res) behind the registry's interfaces.

On the CPU: fla-core's own naive ``naive_attnres`` (an implementation independent of this
project) pins the argument mapping that ``fla_phase2`` uses and serves as a second
reference for the Triton kernels (interpreted); the torch fold that lets flash-attn-res's
phase 2 take several extra sources is checked against the reference; the requirement reasons
are the one-liners a config refusal shows. On a CUDA device (marked ``cuda``) the adapters
themselves run against the reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from attnres_dist.ops import depth_attention_reference, get_depth_attention
from attnres_dist.ops.outside_kernels import merge_sources

EPS = 1e-6
NS = (1, 2, 3, 9, 17)


def load_fla_naive():
    """fla-core's ``naive_attnres``, loaded from its file: the fla package imports every one
    of its ops on import (~10 s here); this file needs only torch and einops."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        pytest.skip("fla-core is not installed")
    path = Path(spec.origin).parent / "ops" / "attnres" / "naive.py"
    module_spec = importlib.util.spec_from_file_location("_fla_attnres_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_attnres


def make_sources(n, dtype, shape=(3, 5, 32), seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, 1, 1, generator=gen) * 3 + 0.25
    sources = (torch.randn(n, *shape, generator=gen) * scale).to(dtype)
    query = 0.5 * torch.randn(shape[-1], generator=gen)
    gain = 1.0 + 0.3 * torch.randn(shape[-1], generator=gen)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return sources, query, gain, grad


def run(fn, sources, query, gain, grad, wide=None):
    cast = (lambda t: t.to(wide)) if wide is not None else (lambda t: t)
    src = [cast(s).detach().requires_grad_() for s in sources.unbind(0)]
    q, g = cast(query).detach().requires_grad_(), cast(gain).detach().requires_grad_()
    out = fn(q, src, g)
    grads = torch.autograd.grad((out.float() * grad.float()).sum(), [q, g, *src])
    return [out, *grads]


def assert_all_close(actual, expected, tol_values, tol_params=1e-4):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        t = tol_params if i in (1, 2) else tol_values
        torch.testing.assert_close(
            a.double(), e.double(), atol=t, rtol=t, msg=lambda m, i=i: f"[{i}] {m}"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", NS)
def test_fla_naive_mapping_equals_reference(dtype, n):
    naive = load_fla_naive()
    sources, query, gain, grad = make_sources(n, dtype, seed=n)
    fla = run(lambda q, s, g: naive(q, s, g, rms_eps=EPS), sources, query, gain, grad)
    ref = run(
        lambda q, s, g: depth_attention_reference(q, s, g, eps=EPS), sources, query, gain, grad
    )
    assert_all_close(fla, ref, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", NS)
def test_triton_kernels_match_fla_naive(dtype, n, monkeypatch):
    pytest.importorskip("triton")
    from attnres_dist.ops.triton_kernels import interpreter_problem

    if interpreter_problem() is not None:
        pytest.skip(f"Triton's interpreter fails here: {interpreter_problem()}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    naive = load_fla_naive()
    sources, query, gain, grad = make_sources(n, dtype, seed=100 + n)
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    got = run(get_depth_attention("triton"), sources, query, gain, grad)
    want = run(lambda q, s, g: naive(q, s, g, rms_eps=EPS), sources, query, gain, grad, wide)
    assert_all_close(got, want, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("k", [1, 2])
def test_merge_sources_equals_one_pass(k):
    sources, query, gain, _ = make_sources(3 + k, torch.float64, seed=k)
    blocks, extra = sources[:3], sources[3:]
    u = gain * query
    r = torch.rsqrt(blocks.pow(2).mean(-1) + EPS)
    logits = (blocks * u).sum(-1) * r
    out1 = (torch.softmax(logits, 0)[..., None] * blocks).sum(0)
    out, lse = merge_sources(out1, torch.logsumexp(logits, 0), extra, u, EPS)
    want = depth_attention_reference(query, list(sources.unbind(0)), gain, eps=EPS)
    all_r = torch.rsqrt(sources.pow(2).mean(-1) + EPS)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)
    want_lse = torch.logsumexp((sources * u).sum(-1) * all_r, 0)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU reasons")
def test_requirements_name_what_is_missing_here():
    for name in ("fla", "flash_attn_res"):
        impl = get_depth_attention(name)
        assert impl.devices == ("cuda",)
        reason = impl.requirement()
        assert reason is not None and "\n" not in reason
        assert reason.startswith(("needs a CUDA device", "triton is not installed")) or (
            "is not installed" in reason
        )
    assert get_depth_attention("flash_attn_res").two_phase
    assert not get_depth_attention("fla").two_phase


def _require(name):
    reason = get_depth_attention(name).requirement()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", NS)
def test_fla_one_pass_on_cuda(dtype, n):
    _require("fla")
    sources, query, gain, grad = (t.cuda() for t in make_sources(n, dtype, seed=n))
    got = run(get_depth_attention("fla"), sources, query, gain, grad)
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    want = run(
        lambda q, s, g: depth_attention_reference(q, s, g, eps=EPS),
        sources,
        query,
        gain,
        grad,
        wide,
    )
    assert_all_close(got, want, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n", NS)
def test_flash_attn_res_two_phase_on_cuda(n, m):
    _require("flash_attn_res")
    impl = get_depth_attention("flash_attn_res")
    dtype = torch.bfloat16  # its kernels round their results to bfloat16
    sources, query, gain, grad = (t.cuda() for t in make_sources(n + m, dtype, seed=n))
    queries = torch.stack([query, 0.7 * query.flip(0)])
    gains = torch.stack([gain, gain.flip(0)])
    b, e, q, g = (t.clone().requires_grad_() for t in (sources[:n], sources[n:], queries, gains))
    weights = torch.stack((q, g), 1)
    out1, lse = impl.phase1(b, weights, eps=EPS)
    outs = [impl.phase2(out1[i], lse[i], e, weights[i], eps=EPS) for i in range(2)]
    got = torch.autograd.grad(sum((o.float() * grad.float()).sum() for o in outs), [b, e, q, g])
    b2, e2, q2, g2 = (t.detach().float().requires_grad_() for t in (b, e, q, g))
    src = [*b2.unbind(0), *e2.unbind(0)]
    refs = [depth_attention_reference(q2[i], src, g2[i], eps=EPS) for i in range(2)]
    want = torch.autograd.grad(sum((o * grad.float()).sum() for o in refs), [b2, e2, q2, g2])
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o.float(), r, atol=3e-2, rtol=3e-2)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), w, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    "mode, size", [("block", 3), ("full", 1), ("delta_block", 2), ("delta_full", 1)]
)
def test_model_on_a_stacked_one_pass_kernel(mode, size, monkeypatch):
    """A one-pass kernel that takes the sources stacked (as fla's ``fused_attnres`` does; here
    fla-core's own ``naive_attnres``, on the CPU) serves the model through phase 2 alone, over
    the empty phase 1: loss and every gradient match the two-phase torch ops."""
    from attnres_dist.ops import DepthAttentionImpl, register_depth_attention
    from attnres_dist.ops.depth_attention import one_pass_phase2
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed
    from tests.test_model_two_phase import assert_same, build, loss_and_grads

    naive = load_fla_naive()
    registry = dict(importlib.import_module("attnres_dist.ops")._REGISTRY)
    monkeypatch.setattr("attnres_dist.ops._REGISTRY", registry)

    def kernel(query, sources, gain, eps):
        assert isinstance(sources, torch.Tensor)  # stacked, as fused_attnres takes them
        return naive(query, sources, gain, rms_eps=eps)

    register_depth_attention(
        DepthAttentionImpl("fla_naive", phase2=one_pass_phase2(kernel, stacked=True))
    )
    init_distributed(ParallelDims(), seed=0)
    want = loss_and_grads(build("twophase", mode, size, 4))
    assert_same(loss_and_grads(build("fla_naive", mode, size, 4)), want)
