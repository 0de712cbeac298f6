"""The fused C RMSNorm (``attnres_dist.ops.cpu_rms_norm``) against the definition, and in the model.

Expected values come from the definition, ``x / sqrt(mean(x^2) + eps) * w``, written out here in
float64 (not torch's rms_norm, which the kernel replaces, and not the kernel's backward rule:
the gradients are autograd's of that definition).
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.ops.cpu_rms_norm import CpuRMSNorm, requirement, rms_norm

pytestmark = pytest.mark.skipif(requirement() is not None, reason=f"no C kernels: {requirement()}")


def definition(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("shape", [(1, 1), (5, 3, 7), (2048, 128), (16, 9, 64), (3, 2, 200)])
def test_values_and_gradients_match_the_definition_fp32(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 3
    w = 1 + 0.5 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    grad = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = definition(x64, w64, 1e-5)
    want_gx, want_gw = torch.autograd.grad(want, (x64, w64), grad)
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    got = rms_norm(x32, w32, 1e-5)
    gx, gw = torch.autograd.grad(got, (x32, w32), grad.float())
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(gx.double(), want_gx, rtol=0, atol=1e-5)
    # the gain's gradient sums over every token: relative to its size
    assert (gw.double() - want_gw).abs().max() <= 1e-5 * want_gw.abs().max().clamp(min=1)


def test_non_contiguous_input_and_a_gain_without_gradient():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(16, 8, 64, generator=gen, dtype=torch.float64)
    w = torch.rand(64, generator=gen, dtype=torch.float64) + 0.5
    x = base.float().transpose(0, 1).requires_grad_()  # [8, 16, 64], not contiguous
    got = rms_norm(x, w.float(), 1e-6)
    (gx,) = torch.autograd.grad(got.square().sum(), (x,))
    ref_x = base.transpose(0, 1).clone().requires_grad_()
    want = definition(ref_x, w, 1e-6)
    (want_gx,) = torch.autograd.grad(want.square().sum(), (ref_x,))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(gx.double(), want_gx, rtol=0, atol=2e-5)


def test_bf16_is_computed_in_float32_and_cast_back():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 48, generator=gen).bfloat16().requires_grad_()
    w = (torch.rand(48, generator=gen) + 0.5).bfloat16().requires_grad_()
    got = rms_norm(x, w, 1e-5)
    gx, gw = torch.autograd.grad(got.float().sum(), (x, w))
    assert got.dtype == gx.dtype == gw.dtype == torch.bfloat16
    x64, w64 = x.double().detach().requires_grad_(), w.double().detach().requires_grad_()
    want = definition(x64, w64, 1e-5)
    want_gx, want_gw = torch.autograd.grad(want.sum(), (x64, w64))
    # one bf16 rounding of each result (2^-8 relative)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gx.double(), want_gx, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gw.double(), want_gw, rtol=1e-2, atol=1e-1)


def test_float64_takes_torchs_function():
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.ones(8, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), definition(x, w, 1e-5))


def test_module_has_torchs_parameter_and_megatrons_signature():
    from attnres_dist.config import load_config
    from attnres_dist.model.megatron_config import transformer_config

    config = transformer_config(load_config("configs/tiny.yaml").model)
    norm = CpuRMSNorm(config, 32, eps=1e-6)
    torch_norm = torch.nn.RMSNorm(32, eps=1e-6)
    assert norm.state_dict().keys() == torch_norm.state_dict().keys() == {"weight"}
    torch.testing.assert_close(norm.weight, torch_norm.weight)
    norm.load_state_dict({"weight": torch.linspace(0.5, 1.5, 32)})
    x = torch.randn(5, 2, 32)
    want = definition(x.double(), norm.weight.detach().double(), 1e-6)
    torch.testing.assert_close(norm(x).double(), want, rtol=0, atol=1e-5)


def _model(norm: str, mode: str):
    from attnres_dist.config import load_config
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
    from attnres_dist.runtime import select_runtime

    words = [f"runtime.fused_norm={norm}", f"model.attnres.mode={mode}", "model.seq_length=32"]
    cfg = load_config("configs/tiny.yaml", words)
    runtime = select_runtime(cfg.runtime)
    return AttnResGPT(ModelBuilder(cfg.model, 257, seed=cfg.train.seed, runtime=runtime))


@pytest.mark.parametrize("mode", ["baseline", "block"])
def test_the_model_with_the_fused_norm_equals_the_model_with_torchs(mode):
    """Every norm of the model (the layers' two and the final one) is the C kernel under
    ``auto`` on CPU; loss and every gradient equal the torch-norm model's (fp32)."""
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    init_distributed(ParallelDims(), seed=0)
    fused, plain = _model("auto", mode), _model("off", mode)
    kinds = {type(m).__name__ for m in fused.modules() if "norm" in type(m).__name__.lower()}
    assert "CpuRMSNorm" in kinds and "RMSNorm" not in kinds
    assert plain.state_dict().keys() == fused.state_dict().keys()
    window = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (fused, plain):
        loss = model.loss(window)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-5)
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters(), strict=True):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
