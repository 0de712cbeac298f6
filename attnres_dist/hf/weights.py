"""Canonical (single-process ``AttnResGPT``) parameter names -> the Hugging Face model's.

Full tensors only (checkpoints hold tensor-parallel shards already gathered, whatever layout
wrote them). Two weights change layout on the way:

* ``linear_qkv`` ``[g * (q/g + 2) * d, h]`` is Megatron's per-query-group interleave
  ``[q_1 .. q_{q/g}, k, v]`` for each of the ``g`` groups; it becomes ``q_proj`` (heads in
  group order, so query head ``i`` belongs to group ``i // (q/g)``), ``k_proj``, ``v_proj``.
* ``linear_fc1`` ``[2f, h]`` is ``[gate; up]`` (Megatron's SwiGLU chunk; under tensor
  parallelism it is split with stride 2, and the checkpoint gathers it back to this order).

Transformer Engine layer specs fuse the PreNorm gains into the linear layers
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); both spellings map to
the same Hugging Face names. Anything unknown is an error, never silently dropped.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_TOP = {
    "embedding.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "final.final_norm.weight": "model.norm.weight",
    "final.mixer.query": "model.final_mixer.query",
    "final.mixer.key_norm_weight": "model.final_mixer.key_norm_weight",
    "output.lm_head.weight": "lm_head.weight",
}
_IN_LAYER = {
    "layer.input_layernorm.weight": "input_layernorm.weight",
    "layer.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "layer.self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "layer.pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "layer.mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "layer.mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "attn_mixer.query": "attn_mixer.query",
    "attn_mixer.key_norm_weight": "attn_mixer.key_norm_weight",
    "mlp_mixer.query": "mlp_mixer.query",
    "mlp_mixer.key_norm_weight": "mlp_mixer.key_norm_weight",
}


def split_qkv(weight: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Megatron's fused QKV weight -> (q, k, v) weights in Hugging Face's layout."""
    per_group = heads // groups
    w = weight.reshape(groups, per_group + 2, head_dim, weight.shape[-1])
    q = w[:, :per_group].reshape(heads * head_dim, -1)
    k = w[:, per_group].reshape(groups * head_dim, -1)
    v = w[:, per_group + 1].reshape(groups * head_dim, -1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def hf_state_dict(
    tensors: dict[str, torch.Tensor], heads: int, groups: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict for canonical ``tensors`` (a tied head is not repeated)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name in _TOP:
            out[_TOP[name]] = value.contiguous()
            continue
        match = _LAYER.match(name)
        if match is None:
            raise KeyError(f"unknown parameter {name!r}")
        prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
        if rest == "layer.self_attention.linear_qkv.weight":
            q, k, v = split_qkv(value, heads, groups, head_dim)
            out[prefix + "self_attn.q_proj.weight"] = q
            out[prefix + "self_attn.k_proj.weight"] = k
            out[prefix + "self_attn.v_proj.weight"] = v
        elif rest == "layer.mlp.linear_fc1.weight":
            gate, up = torch.chunk(value, 2, dim=0)
            out[prefix + "mlp.gate_proj.weight"] = gate.contiguous()
            out[prefix + "mlp.up_proj.weight"] = up.contiguous()
        elif rest in _IN_LAYER:
            out[prefix + _IN_LAYER[rest]] = value.contiguous()
        else:
            raise KeyError(f"unknown parameter {name!r}")
    return out
