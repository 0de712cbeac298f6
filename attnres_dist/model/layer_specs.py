"""A RuntimeChoice turned into the Megatron-Core layer spec and final norm the model builds with.

* ``layer_spec``: Megatron-Core's Transformer Engine layer spec or its local one. Both expose
  ``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm`` and ``mlp``; under TE the two
  norms are identities because TE fuses each norm into the linear after it, so the AttnRes
  layer's ``f(x) = Sublayer(Norm(x))`` holds either way. Parameter names differ between the
  two specs: a checkpoint belongs to the spec it was trained with.
* ``core_attention``: under the local spec, ``SdpaAttention`` (torch's fused SDPA) in place of
  Megatron's ``DotProductAttention`` and ``SdpaSelfAttention`` (rotary embedding from tables)
  in place of ``SelfAttention``, or Megatron's own; the parameters are the same, so the
  choice never changes a checkpoint. The TE spec keeps TE's attention.
* ``TraceableRowParallelLinear`` (``model/traceable_linear.py``) for the attention output
  projection and the MLP's second linear of the local spec: Megatron's ``RowParallelLinear``
  with the group lookup a compiler cannot trace taken out (same parameters and arithmetic).
* norms: apex's FusedRMSNorm (GPU), the project's fused C RMSNorm (``cpu``:
  ``attnres_dist.ops.cpu_rms_norm``) or torch's RMSNorm (``TorchRMSNorm``: Megatron's
  ``WrappedTorchNorm`` without its refusal of sequence parallelism), built with Megatron's norm
  signature
  (Megatron's own apex norm, FusedLayerNorm, refuses RMSNorm). All name their gain ``weight``,
  so the choice never changes a checkpoint.
"""

from __future__ import annotations

import torch

from attnres_dist.model.sdpa_attention import SdpaAttention, SdpaSelfAttention
from attnres_dist.model.traceable_linear import TraceableRowParallelLinear
from attnres_dist.ops.cpu_rms_norm import CpuRMSNorm  # Megatron's norm signature
from attnres_dist.runtime.choice import RuntimeChoice


def layer_spec(choice: RuntimeChoice, qk_norm: bool = False):
    """The dense layer's spec; ``qk_norm``: each head's query and key normed (Qwen3's)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if choice.layer_spec.value == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    spec.submodules.mlp.submodules.linear_fc2 = TraceableRowParallelLinear
    return patched(spec, choice)


def patched(spec, choice: RuntimeChoice):
    """A local spec (dense, or with the MoE MLP: ``model/moe.py``) with the attention and the
    norms the runtime chose."""
    from megatron.core.transformer.identity_op import IdentityOp

    spec.submodules.self_attention.submodules.linear_proj = TraceableRowParallelLinear
    if choice.core_attention.value == "sdpa":
        spec.submodules.self_attention.module = SdpaSelfAttention
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    norm = _NORMS.get(choice.norm.value)
    if norm is not None:
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        attention = spec.submodules.self_attention.submodules
        for name in ("q_layernorm", "k_layernorm"):  # where the spec norms them (qk_norm)
            if getattr(attention, name) is not IdentityOp:
                setattr(attention, name, norm)
    return spec


class TorchRMSNorm:
    """torch's RMSNorm behind Megatron's norm constructor: what Megatron's ``WrappedTorchNorm``
    builds, without its refusal of sequence parallelism (Megatron refuses because it would not
    sum the gain's gradient over the tensor ranks; ``pipeline/sequence_parallel.py`` does)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return torch.nn.RMSNorm(hidden_size, eps=eps)


class ApexRMSNorm:
    """apex FusedRMSNorm behind Megatron's norm constructor ``(config, hidden_size, eps)``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        from apex.normalization import FusedRMSNorm

        return FusedRMSNorm(hidden_size, eps=eps)


_NORMS = {"apex": ApexRMSNorm, "cpu": CpuRMSNorm, "torch": TorchRMSNorm}


def final_norm(choice: RuntimeChoice, config) -> torch.nn.Module | None:
    """The final norm to use instead of the default torch one, or None to keep it."""
    norm = _NORMS.get(choice.norm.value)
    if norm is None:
        return None
    return norm(config, config.hidden_size, eps=config.layernorm_epsilon)
