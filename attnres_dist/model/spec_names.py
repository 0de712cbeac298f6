"""Parameter names of the two layer specs, and the map from Transformer Engine's to the local ones.

Megatron-Core's local spec (``get_gpt_layer_local_spec``) gives each layer separate norms,
``input_layernorm`` and ``pre_mlp_layernorm``, in front of ``self_attention.linear_qkv`` and
``mlp.linear_fc1``. Its Transformer Engine spec (``get_gpt_layer_with_transformer_engine_spec``)
fuses each norm into the linear after it (``TELayerNormColumnParallelLinear``), so the gain is
``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight`` and the
norms themselves are identities; every weight matrix has the same name, shape and layout in
both. TE modules also carry ``_extra_state`` (FP8 metadata), which is not a weight. Megatron
states the same correspondence in the local spec's ``sharded_state_dict_keys_map``.

The local names are canonical: exports always hold them, whichever spec trained the model.
"""

from __future__ import annotations

# fused TE name part -> local name part (norm biases exist only for LayerNorm, not RMSNorm)
TE_TO_LOCAL = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".self_attention.linear_qkv.layer_norm_bias": ".input_layernorm.bias",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_bias": ".pre_mlp_layernorm.bias",
}
EXTRA_STATE = "._extra_state"


def spec_of(names) -> str:
    """``te`` when any name is one of TE's fused norm gains, else ``local``."""
    return "te" if any(te in name for name in names for te in TE_TO_LOCAL) else "local"


def local_name(name: str) -> str | None:
    """The local-spec name of a parameter named by either spec; None for TE's extra state."""
    if name.endswith(EXTRA_STATE):
        return None
    for te, local in TE_TO_LOCAL.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def to_local_names(state: dict) -> dict:
    """``state`` keyed by local-spec names, TE's extra state dropped."""
    out = {}
    for name, value in state.items():
        local = local_name(name)
        if local is None:
            continue
        if local in out:
            raise ValueError(f"{name!r} and another entry both map to {local!r}")
        out[local] = value
    return out
