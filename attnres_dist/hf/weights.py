"""Canonical (single-process ``AttnResGPT``) parameter names -> the Hugging Face model's.

Full tensors only (checkpoints hold tensor-parallel shards already gathered, whatever layout
wrote them). Two weights change layout on the way:

* ``linear_qkv`` ``[g * (q/g + 2) * d, h]`` is Megatron's per-query-group interleave
  ``[q_1 .. q_{q/g}, k, v]`` for each of the ``g`` groups; it becomes ``q_proj`` (heads in
  group order, so query head ``i`` belongs to group ``i // (q/g)``), ``k_proj``, ``v_proj``.
* ``linear_fc1`` ``[2f, h]`` is ``[gate; up]`` (Megatron's SwiGLU chunk; under tensor
  parallelism it is split with stride 2, and the checkpoint gathers it back to this order),
  also each expert's and the shared expert's of an MoE layer (``mlp.experts.{e}``,
  ``mlp.shared_expert``; the router becomes ``mlp.gate``).

Transformer Engine layer specs fuse the PreNorm gains into the linear layers
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); both spellings map to
the same Hugging Face names. Each packed ``mixer_weights`` (a layer's two depth mixers, or the
final aggregation's one) becomes one ``query`` and one ``key_norm_weight`` per mixer.
Anything unknown is an error, never silently dropped.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_TOP = {
    "embedding.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "final.final_norm.weight": "model.norm.weight",
    "output.lm_head.weight": "lm_head.weight",
}
_IN_LAYER = {
    "layer.input_layernorm.weight": "input_layernorm.weight",
    "layer.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "layer.self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "layer.pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "layer.mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "layer.mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# an MoE layer's router, experts and shared expert (Megatron's MoELayer -> AttnResMoE)
_MOE = re.compile(
    r"^layer\.mlp\.(?:experts\.local_experts\.(\d+)|(shared_experts))\.linear_fc([12])\.weight$"
)
_ROUTER = ("layer.mlp.router.weight", "mlp.gate.weight")
# each head's query and key norm (qk_norm): Megatron's q_layernorm / k_layernorm
_QK_NORMS = {
    "layer.self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "layer.self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# the packed depth-mixer weights [mixers, (query, key gain), D]: one Hugging Face mixer a row
_FINAL_MIXERS = ("model.final_mixer.",)
_LAYER_MIXERS = ("attn_mixer.", "mlp_mixer.")


def split_mixers(weights: torch.Tensor, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Packed ``mixer_weights`` -> each mixer's ``query`` and ``key_norm_weight``."""
    if weights.shape[:2] != (len(prefixes), 2):
        raise KeyError(f"mixer weights of shape {list(weights.shape)}, not [{len(prefixes)}, 2, D]")
    out = {}
    for prefix, (query, gain) in zip(prefixes, weights, strict=True):
        out[prefix + "query"] = query.contiguous()
        out[prefix + "key_norm_weight"] = gain.contiguous()
    return out


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
        if name == "final.mixer_weights":
            out.update(split_mixers(value, _FINAL_MIXERS))
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
        elif rest == "mixer_weights":
            out.update(split_mixers(value, tuple(prefix + m for m in _LAYER_MIXERS)))
        elif rest == _ROUTER[0]:
            out[prefix + _ROUTER[1]] = value.contiguous()
        elif rest in _QK_NORMS:
            out[prefix + _QK_NORMS[rest]] = value.contiguous()
        elif moe := _MOE.match(rest):
            expert = f"mlp.experts.{moe[1]}." if moe[1] is not None else "mlp.shared_expert."
            if moe[3] == "1":
                gate, up = torch.chunk(value, 2, dim=0)
                out[prefix + expert + "gate_proj.weight"] = gate.contiguous()
                out[prefix + expert + "up_proj.weight"] = up.contiguous()
            else:
                out[prefix + expert + "down_proj.weight"] = value.contiguous()
        elif rest in _IN_LAYER:
            out[prefix + _IN_LAYER[rest]] = value.contiguous()
        else:
            raise KeyError(f"unknown parameter {name!r}")
    return out


# ----------------------------------------------------------------- Llama-family -> canonical

# Hugging Face Llama / Mistral names -> canonical ones (the plain weights of _TOP and _IN_LAYER
# read backwards: no depth-attention parameters, no Transformer Engine spellings)
_FROM_HF_TOP = {hf: ours for ours, hf in _TOP.items()}
_FROM_HF_LAYER = {
    hf: ours
    for ours, hf in _IN_LAYER.items()
    if ours.startswith("layer.") and "layer_norm_weight" not in ours
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MIXTRAL_ROUTER = "block_sparse_moe.gate.weight"
_MIXTRAL_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.w[123]\.weight$")
_QWEN_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(?:gate|up|down)_proj\.weight$")
# buffers some older checkpoints saved beside the weights: recomputed, never weights
_HF_IGNORED = ("self_attn.rotary_emb.inv_freq",)


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int):
    """Hugging Face's (q, k, v) weights -> Megatron's fused QKV (``split_qkv`` read backwards):
    for each of the ``groups`` key/value groups, its ``heads / groups`` query heads, then its
    key head, then its value head."""
    head_dim = q.shape[0] // heads
    hidden = q.shape[-1]
    per_group = heads // groups
    q = q.reshape(groups, per_group, head_dim, hidden)
    k = k.reshape(groups, 1, head_dim, hidden)
    v = v.reshape(groups, 1, head_dim, hidden)
    return torch.cat((q, k, v), dim=1).reshape(-1, hidden).contiguous()


def canonical_state_dict(
    hf: dict[str, torch.Tensor], num_layers: int, heads: int, groups: int, tied: bool
) -> dict[str, torch.Tensor]:
    """The canonical state dict of a Llama-family model's Hugging Face weights ``hf``.

    Depth-attention parameters are not among them (a Llama has none). A tied model's
    ``lm_head.weight``, where the checkpoint repeats it, must equal the embedding. Anything
    unknown or missing raises ``KeyError`` naming it."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(num_layers)}
    for name, value in hf.items():
        if name == "lm_head.weight" and tied:
            if not torch.equal(value, hf.get("model.embed_tokens.weight", value)):
                raise KeyError("lm_head.weight differs from model.embed_tokens.weight")
            continue
        if name in _FROM_HF_TOP:
            out[_FROM_HF_TOP[name]] = value
            continue
        match = _HF_LAYER.match(name)
        if match is None or int(match.group(1)) not in layers:
            raise KeyError(f"unknown weight {name!r}")
        if match.group(2) not in _HF_IGNORED:
            layers[int(match.group(1))][match.group(2)] = value
    for i, parts in layers.items():
        out.update(_canonical_layer(i, parts, heads, groups))
    for name in _FROM_HF_TOP.values():
        if name not in out and not (tied and name.startswith("output.")):
            raise KeyError(f"missing weight for {name!r}")
    return out


def _canonical_layer(i: int, parts: dict, heads: int, groups: int) -> dict[str, torch.Tensor]:
    """Canonical weights of layer ``i`` from its Hugging Face ``parts`` (name -> tensor)."""
    prefix, hf_prefix = f"layers.{i}.", f"model.layers.{i}."

    def take(part: str) -> torch.Tensor:
        if part not in parts:
            raise KeyError(f"missing weight {hf_prefix + part!r}")
        return parts.pop(part)

    out = {}
    q, k, v = (take(f"self_attn.{p}_proj.weight") for p in "qkv")
    out[prefix + "layer.self_attention.linear_qkv.weight"] = merge_qkv(q, k, v, heads, groups)
    for ours, hf_part in _QK_NORMS.items():  # Qwen3's query and key norms, where present
        if hf_part in parts:
            out[prefix + ours] = take(hf_part)
    # (router, per expert: (HF gate, up, down) names) of an MoE layer, or None: dense
    moe = None
    if _MIXTRAL_ROUTER in parts:  # Mixtral: w1 the gate, w3 the up, w2 the down
        found = {int(m[1]) for name in parts if (m := _MIXTRAL_EXPERT.match(name))}
        moe = _MIXTRAL_ROUTER, {e: f"block_sparse_moe.experts.{e}.w{{}}.weight" for e in found}
        names = ("1", "3", "2")
    elif _ROUTER[1] in parts:  # Qwen3-MoE: mlp.gate and mlp.experts.{e}.*_proj
        found = {int(m[1]) for name in parts if (m := _QWEN_EXPERT.match(name))}
        moe = _ROUTER[1], {e: f"mlp.experts.{e}.{{}}_proj.weight" for e in found}
        names = ("gate", "up", "down")
    if moe is not None:
        router, experts = moe
        out[prefix + _ROUTER[0]] = take(router)
        for e, pattern in sorted(experts.items()):
            gate, up, down = (take(pattern.format(n)) for n in names)
            ours = f"{prefix}layer.mlp.experts.local_experts.{e}."
            out[ours + "linear_fc1.weight"] = torch.cat((gate, up), dim=0)
            out[ours + "linear_fc2.weight"] = down
    else:
        gate, up = take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")
        out[prefix + "layer.mlp.linear_fc1.weight"] = torch.cat((gate, up), dim=0)
    for hf_part, ours in _FROM_HF_LAYER.items():
        if not (moe and hf_part.startswith("mlp.")):  # an MoE layer has no dense MLP
            out[prefix + ours] = take(hf_part)
    if parts:
        raise KeyError(f"unknown weight {hf_prefix + sorted(parts)[0]!r}")
    return out
