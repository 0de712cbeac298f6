"""RMSNorm on the CPU through the project's fused C kernel (``csrc/rms_norm_cpu.c``).

``rms_norm(x, weight, eps)`` is ``torch.nn.functional.rms_norm(x, (D,), weight, eps)``: one
pass over the tokens forward (saving one float per token, the reciprocal root mean square) and
one backward, where torch's CPU rms_norm runs under autograd as about ten elementwise ops, each
a pass over the whole ``[tokens, D]``. Computed in float32 (bfloat16 / float16 inputs are
upcast and the result cast back); float64 or tensors off the CPU take torch's function.
:func:`requirement` says why the kernel cannot run here (None when it can).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnres_dist.ops.cpu_library import call, cast, f32, ptr, requirement, runs_here

__all__ = ["CpuRMSNorm", "requirement", "rms_norm"]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        dim = x.shape[-1]
        xf, w = f32(x), f32(weight)
        tokens = xf.numel() // dim
        y, rstd = torch.empty(xf.shape), torch.empty(tokens)
        call(
            "rms_norm_fwd", ptr(xf), ptr(w), tokens, dim, eps, ptr(y), ptr(rstd),
            torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(x, weight, rstd)
        ctx.set_materialize_grads(False)
        return cast(y, x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        if grad is None:
            return None, None, None
        dim = x.shape[-1]
        xf, w, g = f32(x), f32(weight), f32(grad)
        tokens = xf.numel() // dim
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = torch.empty(xf.shape)  # the kernel forms it on the way to the gain's gradient
        gw = torch.empty(weight.shape) if need_w else None
        call(
            "rms_norm_bwd", ptr(xf), ptr(w), ptr(rstd), ptr(g), tokens, dim, ptr(gx), ptr(gw),
            torch.get_num_threads(),
        )  # fmt: skip
        grad_x = cast(gx, x.dtype) if need_x else None
        return grad_x, None if gw is None else cast(gw, weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm over the last dimension with gain ``weight`` ``[D]``."""
    if not runs_here(x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)


class CpuRMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm(hidden_size, eps)`` (same parameter, ``weight``, initialised to ones)
    computed by :func:`rms_norm`; built with Megatron's norm signature
    ``(config, hidden_size, eps)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))  # as WrappedTorchNorm's

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
