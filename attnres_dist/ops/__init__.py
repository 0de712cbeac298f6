"""Depth-attention backends and the registry that selects them (``model.attnres.impl``).

A backend computes the paper's two-phase depth attention through two calls, one signature
each, whatever runs them (torch ops, the project's C or Triton kernels, an outside package):

* ``phase1(blocks, weights, eps, **options) -> (out1, lse)``: the ``S`` mixers whose packed
  ``weights`` ``[S, 2, D]`` (each row a pseudo-query and its key gain) attend over the ``n``
  completed blocks ``[n, *batch, D]`` in one batched pass; ``out1`` is S tensors
  ``[*batch, D]``, ``lse`` S tensors ``[*batch]`` (float32; float64 for float64 blocks).
* ``phase2(out1, lse, extra, weights, eps, **options) -> out``: one mixer (``weights``
  ``[2, D]``) merges the sources not in the store (``extra`` ``[m, *batch, D]``) into its
  phase-1 result by online softmax, in ``extra``'s dtype. The result is exactly the one-pass
  softmax over ``blocks ++ extra``.

A backend that fuses more says which ``options`` its phases take:

* ``grad_into`` (both phases): a callable giving ``(rows, accumulate)``, float32 rows of the
  blocks' (phase 1) or the extras' (phase 2) layout where the backward adds their gradient
  (``accumulate``) or writes it in full, instead of returning it: the model's store buffer
  gathers its rows' gradient so (``model/depth_state.py``);
* ``first_norm`` (phase 1): an RMSNorm's ``(weight, eps)`` applied to the first output;
* ``norm`` (phase 2): an RMSNorm's ``(weight, eps)`` applied to the result.

A one-pass kernel (``lean``, ``reference``, ``fla``) is a backend with phase 2 alone: it
serves the empty phase 1 (``out1 = lse = None``: no block read yet), every source an extra
row (``extra`` may then be a tuple of pieces, read where they lie), and the model runs it so
(``model/depth_mixing.py``). ``requirement()`` says why a backend
cannot run here (None when it can), so a config asking for it is refused with that reason.

Backends: ``reference`` (plain autograd, the ground truth) and ``lean`` (memory-lean), one
pass each; ``twophase`` (:mod:`attnres_dist.ops.two_phase`, torch ops, CPU and GPU, what a compiled
layer traces); ``cpu_fused`` (:mod:`attnres_dist.ops.cpu_two_phase`, the project's C kernels);
``triton``, ``fla`` and ``flash_attn_res`` (:mod:`attnres_dist.ops.kernel_impls`, GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnres_dist.ops import two_phase
from attnres_dist.ops.depth_attention import depth_attention, one_pass_phase2, validate_inputs
from attnres_dist.ops.reference import depth_attention_reference

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
    """One backend: its phase 2, its phase 1 (None: a one-pass kernel), where it runs, what
    it fuses."""

    name: str
    phase1: Callable[..., tuple[Sequence[Tensor], Sequence[Tensor]]] | None = None
    phase2: Callable[..., Tensor] | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    requirement: Callable[[], str | None] = _always_available
    options: frozenset[str] = frozenset()  # of "grad_into", "first_norm", "norm"

    def __post_init__(self):
        if self.phase2 is None:
            raise ValueError(f"backend {self.name!r}: give its phase 2 (a one-pass kernel's)")
        unknown = set(self.options) - {"grad_into", "first_norm", "norm"}
        if unknown:
            raise ValueError(f"backend {self.name!r}: unknown options {sorted(unknown)}")

    @property
    def two_phase(self) -> bool:
        return self.phase1 is not None

    def __call__(
        self,
        query: Tensor,
        sources: Sequence[Tensor],
        norm_weight: Tensor,
        eps: float = 1e-6,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Depth attention over ``sources`` in one call, made of the backend's phases (the
        softmax weights, when asked for, from ``lean``)."""
        validate_inputs(query, sources, norm_weight)
        if return_weights:
            return depth_attention(query, sources, norm_weight, eps=eps, return_weights=True)
        weights = torch.stack((query, norm_weight))
        if self.phase1 is None:  # every source a piece of one row: read where it lies
            return self.phase2(None, None, tuple(s.unsqueeze(0) for s in sources), weights, eps)
        head = sources[0].unsqueeze(0) if len(sources) <= 2 else torch.stack(sources[:-1])
        out1, lse = self.phase1(head, weights.unsqueeze(0), eps)
        if len(sources) == 1:
            return out1[0].to(sources[0].dtype)
        return self.phase2(out1[0], lse[0], sources[-1].unsqueeze(0), weights, eps)


DEFAULT_DEPTH_ATTENTION = "lean"

_REGISTRY: dict[str, DepthAttentionImpl] = {
    "lean": DepthAttentionImpl("lean", phase2=one_pass_phase2(depth_attention)),
    "reference": DepthAttentionImpl("reference", phase2=one_pass_phase2(depth_attention_reference)),
    "twophase": DepthAttentionImpl("twophase", two_phase.phase1, two_phase.phase2),
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
    """Return the depth-attention backend registered as ``impl``."""
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

register_depth_attention(
    DepthAttentionImpl(
        "cpu_fused",
        cpu_two_phase.phase1,
        cpu_two_phase.phase2,
        devices=("cpu",),
        requirement=cpu_two_phase.requirement,
        options=frozenset({"grad_into", "first_norm", "norm"}),
    )
)
