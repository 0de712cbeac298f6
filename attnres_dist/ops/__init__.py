"""Fused/lean tensor ops and the registry that selects their implementation.

Owns the depth-attention implementation registry: every implementation shares the
signature of :class:`DepthAttentionImpl` and is looked up by name with
:func:`get_depth_attention`. ``"lean"`` (the default) is the memory-lean autograd
function and ``"reference"`` the plain-autograd ground truth; accelerator kernels
register themselves with :func:`register_depth_attention` under a new name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from attnres_dist.ops.depth_attention import depth_attention, validate_inputs
from attnres_dist.ops.reference import depth_attention_reference

__all__ = [
    "DEFAULT_DEPTH_ATTENTION",
    "DepthAttentionImpl",
    "available_depth_attention_impls",
    "depth_attention",
    "depth_attention_reference",
    "get_depth_attention",
    "register_depth_attention",
    "validate_inputs",
]


class DepthAttentionImpl(Protocol):
    """Signature shared by every depth-attention implementation."""

    def __call__(
        self,
        query: Tensor,
        sources: Sequence[Tensor],
        norm_weight: Tensor,
        eps: float = 1e-6,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]: ...


DEFAULT_DEPTH_ATTENTION = "lean"

_REGISTRY: dict[str, DepthAttentionImpl] = {
    "lean": depth_attention,
    "reference": depth_attention_reference,
}


def register_depth_attention(
    name: str, impl: DepthAttentionImpl, *, overwrite: bool = False
) -> None:
    """Make ``impl`` selectable as ``get_depth_attention(name)``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"implementation name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"depth-attention implementation {name!r} is already registered")
    _REGISTRY[name] = impl


def available_depth_attention_impls() -> tuple[str, ...]:
    """Names accepted by :func:`get_depth_attention`, sorted."""
    return tuple(sorted(_REGISTRY))


def get_depth_attention(impl: str = DEFAULT_DEPTH_ATTENTION) -> DepthAttentionImpl:
    """Return the depth-attention implementation registered as ``impl``."""
    try:
        return _REGISTRY[impl]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(k) for k in available_depth_attention_impls())
        raise ValueError(
            f"unknown depth-attention implementation {impl!r}; allowed: {allowed}"
        ) from None
