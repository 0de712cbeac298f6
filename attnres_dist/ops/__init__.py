"""Depth-attention ops and the registry that selects their implementation.

Every implementation is a :class:`DepthAttentionImpl`: a name, a one-pass function with the
signature of :func:`depth_attention` (``query, sources, norm_weight, eps, return_weights``) and,
when it supports the paper's two-phase computation, the two phase functions
(``phase1(blocks, queries, norm_weights, eps) -> (out1, lse)`` over the contiguous store of
completed blocks for several sublayers at once, and
``phase2(out1, lse, extra, query, norm_weight, eps) -> out`` merging the sources not in the
store by online softmax). ``requirement()`` says why an implementation cannot run here (None
when it can), so a config asking for it is refused with that reason. An implementation with
``grad_into`` set also takes ``phase1(..., grad_into=f)`` and ``phase2(..., grad_into=f)``:
``f()`` gives ``(rows, accumulate)``, a float32 tensor of the blocks' (the extras') layout that
the backward adds their gradient to (``accumulate``) or, when they hold no value yet, writes in
full, instead of returning it (the model's store buffer gathers its rows' gradient so, in one
tensor, and the first writer of a row spares its zero fill). An implementation may also give
``merge_norm``: phase 2 and the RMSNorm the sublayer applies to its result, fused (same values
as the two composed), and ``phase1_split``: phase 1 over the S queries and gains as separate
``[D]`` tensors, returning S separate outputs and log-sum-exps (the same values as
``phase1``'s slices), so the model's sublayers hand over their parameters and take their slices
with no ``[S, ...]`` stack in either direction.

``"lean"`` is the memory-lean one-pass autograd function, ``"reference"`` the plain-autograd
ground truth, ``"twophase"`` the two-phase computation in torch ops
(:mod:`attnres_dist.ops.two_phase`, CPU and GPU) and ``"cpu_fused"`` the same computation
through the project's fused C kernels (:mod:`attnres_dist.ops.cpu_two_phase`, CPU);
``"triton"``, ``"fla"`` and ``"flash_attn_res"`` are the GPU kernels of
:mod:`attnres_dist.ops.kernel_impls`; other implementations register themselves with
:func:`register_depth_attention`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from attnres_dist.ops.depth_attention import depth_attention, validate_inputs
from attnres_dist.ops.reference import depth_attention_reference
from attnres_dist.ops.two_phase import (
    phase1,
    phase1_packed,
    phase2,
    phase2_packed,
    two_phase_depth_attention,
)

__all__ = [
    "DEFAULT_DEPTH_ATTENTION",
    "DepthAttentionImpl",
    "available_depth_attention_impls",
    "depth_attention",
    "depth_attention_reference",
    "get_depth_attention",
    "register_depth_attention",
    "runnable_depth_attention_impls",
    "validate_inputs",
]


def _always_available() -> str | None:
    return None


@dataclass(frozen=True)
class DepthAttentionImpl:
    """One depth-attention implementation: one-pass function, optional two-phase functions."""

    name: str
    one_pass: Callable[..., Tensor | tuple[Tensor, Tensor]]
    phase1: Callable[..., tuple[Tensor, Tensor]] | None = None
    phase2: Callable[..., Tensor] | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    requirement: Callable[[], str | None] = _always_available
    grad_into: bool = False  # phase1 accepts grad_into= (see the module docstring)
    # phase 2 and the RMSNorm after it, fused:
    # merge_norm(out1, lse, extra, query, norm_weight, rms_weight, eps, norm_eps[, grad_into])
    merge_norm: Callable[..., Tensor] | None = None
    # phase1_split(blocks, queries: [D] x S, norm_weights: [D] x S, eps[, grad_into])
    #   -> (out1 x S, lse x S)
    phase1_split: Callable[..., tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] | None = None
    # phase1 / phase2 with each mixer's query and gain packed ([S, 2, D] / [2, D], slices of
    # the model's mixer_weights): one gradient for both, which the model's parameter takes
    # as it is. phase1_packed(blocks, weights, eps), phase2_packed(out1, lse, extra, weights, eps)
    phase1_packed: Callable[..., tuple[Tensor, Tensor]] | None = None
    phase2_packed: Callable[..., Tensor] | None = None

    @property
    def two_phase(self) -> bool:
        return self.phase1 is not None and self.phase2 is not None

    def __call__(
        self,
        query: Tensor,
        sources: Sequence[Tensor],
        norm_weight: Tensor,
        eps: float = 1e-6,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        return self.one_pass(query, sources, norm_weight, eps=eps, return_weights=return_weights)


DEFAULT_DEPTH_ATTENTION = "lean"

_REGISTRY: dict[str, DepthAttentionImpl] = {
    "lean": DepthAttentionImpl("lean", depth_attention),
    "reference": DepthAttentionImpl("reference", depth_attention_reference),
    "twophase": DepthAttentionImpl(
        "twophase",
        two_phase_depth_attention,
        phase1,
        phase2,
        phase1_packed=phase1_packed,
        phase2_packed=phase2_packed,
    ),
}


def register_depth_attention(impl: DepthAttentionImpl, *, overwrite: bool = False) -> None:
    """Make ``impl`` selectable as ``get_depth_attention(impl.name)``."""
    if not isinstance(impl, DepthAttentionImpl):
        raise ValueError(f"expected a DepthAttentionImpl, got {type(impl).__name__}")
    if not impl.name or not isinstance(impl.name, str):
        raise ValueError(f"implementation name must be a non-empty string, got {impl.name!r}")
    if impl.name in _REGISTRY and not overwrite:
        raise ValueError(f"depth-attention implementation {impl.name!r} is already registered")
    _REGISTRY[impl.name] = impl


def available_depth_attention_impls() -> tuple[str, ...]:
    """Names accepted by :func:`get_depth_attention`, sorted."""
    return tuple(sorted(_REGISTRY))


def runnable_depth_attention_impls() -> dict[str, str | None]:
    """Every registered name mapped to why it cannot run here (None when it can)."""
    return {name: _REGISTRY[name].requirement() for name in available_depth_attention_impls()}


def get_depth_attention(impl: str = DEFAULT_DEPTH_ATTENTION) -> DepthAttentionImpl:
    """Return the depth-attention implementation registered as ``impl``."""
    try:
        return _REGISTRY[impl]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(k) for k in available_depth_attention_impls())
        raise ValueError(
            f"unknown depth-attention implementation {impl!r}; allowed: {allowed}"
        ) from None


# GPU kernels (triton, fla, flash_attn_res): records whose modules import on first call.
from attnres_dist.ops.kernel_impls import KERNEL_IMPLS  # noqa: E402

for _impl in KERNEL_IMPLS:
    register_depth_attention(_impl)

# the fused CPU kernels (compiled on first use; requirement() says why they cannot be)
from attnres_dist.ops import cpu_two_phase  # noqa: E402
from attnres_dist.ops.cpu_merge_norm import merge_rms_norm  # noqa: E402

register_depth_attention(
    DepthAttentionImpl(
        "cpu_fused",
        cpu_two_phase.one_pass,
        cpu_two_phase.phase1,
        cpu_two_phase.phase2,
        devices=("cpu",),
        requirement=cpu_two_phase.requirement,
        grad_into=True,
        merge_norm=merge_rms_norm,
        phase1_split=cpu_two_phase.phase1_split,
    )
)
