"""RMSNorm on the CPU through the project's fused C kernel (``csrc/rms_norm_cpu.c``).

``rms_norm(x, weight, eps)`` is ``torch.nn.functional.rms_norm(x, (D,), weight, eps)``: one
pass over the tokens forward (saving one float per token, the reciprocal root mean square) and
one backward, where torch's CPU rms_norm runs under autograd as about ten elementwise ops, each
a pass over the whole ``[tokens, D]``. Computed in float32 (bfloat16 / float16 inputs are
upcast and the result cast back); float64 or tensors off the CPU take torch's function.
:func:`requirement` says why the kernel cannot run here (None when it can). The kernel
runs as registered ops (``attnres::rms_norm`` and its backward, ``torch.library``), so a
compiled layer (``runtime.compile: layer``) keeps it inside its one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnres_dist.ops.cpu_library import call, cast, f32, ptr, requirement, runs_here

__all__ = ["CpuRMSNorm", "requirement", "rms_norm"]


# Registered ops (torch.library), not an autograd.Function around ctypes calls: TorchDynamo
# cannot trace a ctypes call (a graph break), but keeps a registered op whole in its graph, with
# the fake implementations giving the output shapes; eager, the ops run as before.
@torch.library.custom_op("attnres::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The normalised ``x`` and the reciprocal root mean square of each token (float32)."""
    dim = x.shape[-1]
    xf, w = f32(x), f32(weight)
    tokens = xf.numel() // dim
    y, rstd = torch.empty(xf.shape), torch.empty(tokens)
    call(
        "rms_norm_fwd", ptr(xf), ptr(w), tokens, dim, eps, ptr(y), ptr(rstd),
        torch.get_num_threads(),
    )  # fmt: skip
    return cast(y, x.dtype), rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("attnres::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    x: Tensor, weight: Tensor, rstd: Tensor, grad: Tensor, need_weight: bool
) -> tuple[Tensor, Tensor]:
    """The gradients of ``x`` and of the gain (empty when ``need_weight`` is false)."""
    dim = x.shape[-1]
    xf, w, g = f32(x), f32(weight), f32(grad)
    tokens = xf.numel() // dim
    gx = torch.empty(xf.shape)  # the kernel forms it on the way to the gain's gradient
    gw = torch.empty(weight.shape) if need_weight else None
    call(
        "rms_norm_bwd", ptr(xf), ptr(w), ptr(rstd), ptr(g), tokens, dim, ptr(gx), ptr(gw),
        torch.get_num_threads(),
    )  # fmt: skip
    gw = weight.new_empty(0) if gw is None else cast(gw, weight.dtype)
    return cast(gx, x.dtype), gw


@_rms_norm_backward.register_fake
def _(x, weight, rstd, grad, need_weight):
    return torch.empty_like(x), torch.empty_like(weight) if need_weight else weight.new_empty(0)


def _setup(ctx, inputs, output):
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    gx, gw = _rms_norm_backward(x, weight, rstd, grad, need_w)
    return gx if need_x else None, gw if need_w else None, None


_rms_norm.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm over the last dimension with gain ``weight`` ``[D]``."""
    if not runs_here(x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _rms_norm(x, weight, eps)[0]


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
