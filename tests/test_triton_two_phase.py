"""The project's Triton two-phase kernels against the reference, values and every gradient.

On the CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set per test);
the same tests run compiled on a CUDA device where one exists (marked ``cuda``). Expected
values come from ``depth_attention_reference`` in float64 (float32 inputs) or on the same
bfloat16 values upcast to float32 (bfloat16 inputs), and from a naive formula for phase 1's
``out1`` / ``lse``.

Tolerances (worst observed abs errors over the grid in brackets, the lean op's beside them):
float32 outputs and source gradients atol = rtol = 1e-5 (9e-6; lean 4e-6); query and gain
gradients, sums over every token and block, 1e-4 (4e-5; lean 2.5e-5); bfloat16 outputs and
source gradients atol = rtol = 2e-2, about one bfloat16 rounding of values up to ~10 (7e-2
abs on the largest values; lean 9e-2).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from attnres_dist.ops import depth_attention_reference, get_depth_attention

pytest.importorskip("triton")

from attnres_dist.ops import triton_kernels as K  # noqa: E402
from attnres_dist.ops.triton_two_phase import phase1, phase2  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]
NS = (1, 2, 3, 9, 17)
BATCH = (5, 7)  # 35 tokens: several token tiles, a ragged last one, >1 tile per program
DIM = 24  # not a power of two: the hidden-size masks are exercised
EPS = 1e-6


@pytest.fixture
def mode(request, monkeypatch):
    """Interpret on the CPU, compile on CUDA."""
    device = request.param
    if device == "cpu":
        if K.interpreter_problem() is not None:
            pytest.skip(f"Triton's interpreter fails here: {K.interpreter_problem()}")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return torch.device(device)


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def make_case(n, num_q, m, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    # Per-source scales so that the rms statistic matters; queries large enough for peaked
    # softmaxes.
    scale = torch.rand(n + m, 1, 1, 1, generator=gen) * 3 + 0.25
    sources = torch.randn(n + m, *BATCH, DIM, generator=gen) * scale
    queries = 0.5 * torch.randn(num_q, DIM, generator=gen)
    gains = 1.0 + 0.3 * torch.randn(num_q, DIM, generator=gen)
    grads = torch.randn(num_q, *BATCH, DIM, generator=gen)
    blocks, extra = sources[:n].to(dtype), sources[n:].to(dtype)
    return [t.to(device) for t in (blocks, extra, queries, gains, grads.to(dtype))]


def reference_block(blocks, extra, queries, gains, grads, dtype):
    """One-pass reference per sublayer over blocks ++ extra; returns outputs and gradients."""
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    b, e, q, g = (t.detach().to(wide).requires_grad_() for t in (blocks, extra, queries, gains))
    sources = [*b.unbind(0), *e.unbind(0)]
    outs = [depth_attention_reference(q[i], sources, g[i], eps=EPS) for i in range(q.shape[0])]
    loss = sum((o * gr.to(wide)).sum() for o, gr in zip(outs, grads, strict=True))
    return outs, torch.autograd.grad(loss, [b, e, q, g])


def assert_close(actual, expected, atol, rtol, what):
    torch.testing.assert_close(
        actual.double().cpu(),
        expected.double().cpu(),
        atol=atol,
        rtol=rtol,
        msg=lambda msg: f"{what}: {msg}",
    )


@pytest.mark.parametrize("mode", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("num_q", [1, 3])
@pytest.mark.parametrize("m", [1, 2])
def test_two_phase_matches_one_pass_reference(mode, dtype, n, num_q, m):
    blocks, extra, queries, gains, grads = make_case(n, num_q, m, dtype, mode, seed=n * 10 + m)
    b, e, q, g = (t.clone().requires_grad_() for t in (blocks, extra, queries, gains))
    out1, lse = phase1(b, q, g, eps=EPS)
    assert out1.dtype == lse.dtype == torch.float32
    assert out1.shape == (num_q, *BATCH, DIM) and lse.shape == (num_q, *BATCH)
    outs = [phase2(out1[i], lse[i], e, q[i], g[i], eps=EPS) for i in range(num_q)]
    assert all(o.dtype == dtype and o.shape == (*BATCH, DIM) for o in outs)
    loss = sum((o.float() * gr.float()).sum() for o, gr in zip(outs, grads, strict=True))
    got = torch.autograd.grad(loss, [b, e, q, g])
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32, torch.float32]

    ref_outs, ref_grads = reference_block(blocks, extra, queries, gains, grads, dtype)
    t = tol(dtype)
    for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        assert_close(o, r, t, t, f"out[{i}]")
    assert_close(got[0], ref_grads[0], t, t, "d blocks")
    assert_close(got[1], ref_grads[1], t, t, "d extra")
    assert_close(got[2], ref_grads[2], 1e-4, 1e-4, "d queries")
    assert_close(got[3], ref_grads[3], 1e-4, 1e-4, "d gains")


def naive_phase1(blocks, queries, gains):
    """out1, lse from the definition, float64."""
    b = blocks.double()
    r = torch.rsqrt(b.pow(2).mean(-1) + EPS)  # [n, *batch]
    u = gains.double() * queries.double()  # [S, D]
    logits = torch.einsum("n...d,sd->sn...", b, u) * r  # [S, n, *batch]
    lse = torch.logsumexp(logits, dim=1)
    out1 = torch.einsum("sn...,n...d->s...d", torch.softmax(logits, dim=1), b)
    return out1, lse


@pytest.mark.parametrize("mode", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_lse", [False, True], ids=["out1", "out1+lse"])
@pytest.mark.parametrize("n", [1, 9])
def test_phase1_matches_naive_formula(mode, dtype, use_lse, n):
    blocks, _, queries, gains, grads = make_case(n, 3, 1, dtype, mode, seed=7 + n)
    g_lse = torch.randn(3, *BATCH, generator=torch.Generator().manual_seed(5)).to(mode)
    b, q, g = (t.clone().requires_grad_() for t in (blocks, queries, gains))
    out1, lse = phase1(b, q, g, eps=EPS)
    loss = (out1 * grads.float()).sum() + ((lse * g_lse).sum() if use_lse else 0.0)
    got = torch.autograd.grad(loss, [b, q, g])

    b64, q64, g64 = (t.detach().double().requires_grad_() for t in (blocks, queries, gains))
    out_r, lse_r = naive_phase1(b64, q64, g64)
    loss_r = (out_r * grads.double()).sum() + ((lse_r * g_lse.double()).sum() if use_lse else 0.0)
    want = torch.autograd.grad(loss_r, [b64, q64, g64])
    # Phase 1's outputs are float32 computed from the (possibly bfloat16) blocks themselves.
    assert_close(out1, out_r, 1e-5, 1e-5, "out1")
    assert_close(lse, lse_r, 1e-5, 1e-5, "lse")
    t = tol(dtype)
    assert_close(got[0], want[0], t, t, "d blocks")
    assert_close(got[1], want[1], 1e-4, 1e-4, "d queries")
    assert_close(got[2], want[2], 1e-4, 1e-4, "d gains")


@pytest.mark.parametrize("mode", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_query_groups_accumulate_block_gradients(mode, dtype, monkeypatch):
    # A tiny register budget splits 3 queries into groups of 2: two launches per phase, the
    # second backward launch adding into the first one's float32 gradient.
    monkeypatch.setattr(K, "TILE_BUDGET", 64)
    assert K.tile_sizes(3, 35, DIM) == (2, 1, 32)
    blocks, extra, queries, gains, grads = make_case(3, 3, 1, dtype, mode, seed=3)
    b, e, q, g = (t.clone().requires_grad_() for t in (blocks, extra, queries, gains))
    out1, lse = phase1(b, q, g, eps=EPS)
    outs = [phase2(out1[i], lse[i], e, q[i], g[i], eps=EPS) for i in range(3)]
    loss = sum((o.float() * gr.float()).sum() for o, gr in zip(outs, grads, strict=True))
    got = torch.autograd.grad(loss, [b, e, q, g])
    ref_outs, ref_grads = reference_block(blocks, extra, queries, gains, grads, dtype)
    t = tol(dtype)
    for o, r in zip(outs, ref_outs, strict=True):
        assert_close(o, r, t, t, "out")
    for name, a, w in zip(("blocks", "extra", "queries", "gains"), got, ref_grads, strict=True):
        assert_close(a, w, 1e-4 if name in ("queries", "gains") else t, t, f"d {name}")


@pytest.mark.parametrize("mode", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_one_pass_matches_reference(mode, dtype, n):
    blocks, _, queries, gains, grads = make_case(n, 1, 1, dtype, mode, seed=n)
    src = [s.clone().requires_grad_() for s in blocks.unbind(0)]
    q, g = queries[0].clone().requires_grad_(), gains[0].clone().requires_grad_()
    impl = get_depth_attention("triton")
    out = impl(q, src, g, eps=EPS)
    assert out.dtype == dtype
    got = torch.autograd.grad((out.float() * grads[0].float()).sum(), [q, g, *src])
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    src_r = [s.detach().to(wide).requires_grad_() for s in src]
    q_r, g_r = q.detach().to(wide).requires_grad_(), g.detach().to(wide).requires_grad_()
    out_r = depth_attention_reference(q_r, src_r, g_r, eps=EPS)
    want = torch.autograd.grad((out_r * grads[0].to(wide)).sum(), [q_r, g_r, *src_r])
    t = tol(dtype)
    assert_close(out, out_r, t, t, "out")
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert_close(a, w, 1e-4 if i < 2 else t, t, f"grad[{i}]")
    # The weights (the diagnostics' path) are the lean op's, equal to the reference's.
    out_w, weights = impl(q, src, g, eps=EPS, return_weights=True)
    _, w_r = depth_attention_reference(q_r, src_r, g_r, eps=EPS, return_weights=True)
    assert_close(weights, w_r, 1e-5, 1e-5, "weights")


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    blocks, extra, queries, gains, _ = make_case(2, 1, 1, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="need CUDA tensors.*TRITON_INTERPRET=1"):
        phase1(blocks, queries, gains)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        phase2(blocks[0], blocks[0, ..., 0], extra, queries[0], gains[0])


def test_bad_shapes_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    blocks, extra, queries, gains, _ = make_case(2, 3, 1, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"queries must be \[S, D\]"):
        phase1(blocks, queries[:, :5], gains)
    with pytest.raises(ValueError, match="queries .* and norm_weights .* differ"):
        phase1(blocks, queries, gains[:2])
    with pytest.raises(ValueError, match="blocks must be"):
        phase1(blocks[:0], queries, gains)
    with pytest.raises(ValueError, match="lse must be"):
        phase2(blocks[0], blocks[0], extra, queries[0], gains[0])
    with pytest.raises(ValueError, match="query must be"):
        phase2(blocks[0], blocks[0, ..., 0], extra, queries, gains[0])


def test_tile_sizes_stay_within_budget():
    for num_q in (1, 3, 6, 8, 16):
        for dim in (24, 512, 1024, 2048, 4096):
            block_s, block_t, block_d = K.tile_sizes(num_q, 16384, dim)
            assert block_d >= dim and block_d & (block_d - 1) == 0
            assert block_s * block_t * block_d <= max(K.TILE_BUDGET, block_d)
            assert block_s <= triton_pow2(num_q) and block_t <= K.MAX_BLOCK_T
    assert K.tile_sizes(3, 1, 24) == (4, 1, 32)  # one token: one-token tiles


def triton_pow2(x):
    return 1 << (x - 1).bit_length()


def test_registry_entry_and_requirement(monkeypatch):
    impl = get_depth_attention("triton")
    assert impl.two_phase and impl.devices == ("cuda",)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if K.interpreter_problem() is None:
        assert impl.requirement() is None
    elif not torch.cuda.is_available():
        assert impl.requirement().startswith("Triton's CPU interpreter fails here")
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        assert impl.requirement().startswith("needs a CUDA device")


def test_importing_the_package_does_not_import_triton():
    code = (
        "import sys, attnres_dist, attnres_dist.ops as ops; "
        "assert 'triton' in ops.available_depth_attention_impls(); "
        "bad = [m for m in ('triton', 'fla', 'flash_attn_res') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kernels_are_compiled_per_interpretation_mode(monkeypatch):
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = K.phase2_fwd_kernel()
    assert type(interpreted).__name__ == "InterpretedFunction"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert isinstance(K.phase2_fwd_kernel(), triton.runtime.JITFunction)


@pytest.mark.parametrize("mode", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_saves_no_keys_or_per_block_intermediates(mode, dtype):
    from bench.saved_bytes import SavedTensorCounter

    n, num_q, tokens = 9, 3, BATCH[0] * BATCH[1]
    blocks, extra, queries, gains, _ = make_case(n, num_q, 1, dtype, mode, seed=1)
    b, e, q, g = (t.clone().requires_grad_() for t in (blocks, extra, queries, gains))
    with SavedTensorCounter() as counter:
        out1, lse = phase1(b, q, g, eps=EPS)
        outs = [phase2(out1[i], lse[i], e, q[i], g[i], eps=EPS) for i in range(num_q)]
    # Beyond the inputs: phase 1's own outputs (float32 out1 and lse) and u = g * w; per
    # sublayer, phase 2's merged log-sum-exp (one float per token) and its u.
    f32 = 4
    expected = f32 * (num_q * tokens * DIM + num_q * tokens + num_q * DIM)
    expected += num_q * f32 * (tokens + DIM)
    assert counter.extra_bytes([b, e, q, g]) == expected
    assert max(s.numel for s in counter.saved) == n * tokens * DIM  # the store itself
    assert len(outs) == num_q
