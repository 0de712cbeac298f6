"""The SDPA attention path: Megatron-Core's self-attention with fewer, fused torch ops.

Two drop-in replacements for the local layer spec (``attnres_dist.model.layer_specs`` installs
both when ``runtime.core_attention`` resolves to ``sdpa``):

* ``SdpaAttention`` for ``core_attention``: one ``scaled_dot_product_attention`` call;
* ``SdpaSelfAttention`` for ``self_attention``: Megatron's ``SelfAttention`` with rotary
  embeddings applied from cos/sin tables that the sequence context builds once per length
  and dtype (``model/sequence_context.py``: ``RotaryTables``), reused by every layer and step
  (Megatron's unfused path recomputes the trigonometry for q and for k in every layer, slices
  the rotary part off and concatenates it back: two full copies per tensor that do nothing
  when the whole head is rotated).

Core attention
--------------

``SdpaAttention`` takes the place of Megatron's ``DotProductAttention`` in the local layer spec
(``core_attention`` of ``SelfAttention``; ``attnres_dist.model.layer_specs`` puts it there). It is
a subclass with the same constructor, so everything Megatron derives there is shared: the
tensor-parallel head split, the softmax scale (``1/sqrt(head_dim)``, ``config.softmax_scale``,
query-key layer scaling), the attention-dropout probability. Only ``forward`` differs: one
fused call instead of ``baddbmm`` + mask fill + softmax + dropout + ``bmm``.

Same math, same layout: query ``[sq, b, np, hn]``, key and value ``[sk, b, ng, hn]`` (grouped-
query attention: query head ``i`` reads key/value group ``i // (np / ng)``, as Megatron's
``repeat_interleave``), output ``[sq, b, np * hn]``. The mask follows Megatron's convention,
``True`` = masked out; no mask runs as ``is_causal=True`` (no mask tensor read: the layer
passes none for the plain causal mask of ``sequence_context``), a boolean mask is passed
explicitly. A row
with every key masked gives NaN here (SDPA) where Megatron's ``-10000`` fill gives a uniform
row; causal masks never have one.

Attention dropout (training mode, ``p > 0``) under tensor parallelism draws inside the
model-parallel RNG tracker's fork, as Megatron's does, so that each tensor rank draws its own
heads' masks. At ``tp = 1`` there are no head shards to tell apart and it draws from the
default generator, which the layer's dropout stream seeds as it seeds the tracker
(``model/dropout_streams.py``): recompute replays it the same way, and a compiled layer runs
it inside its graph (the fork swaps generator states, which TorchDynamo cannot trace). With
``p = 0`` or in eval mode nothing is drawn. The dropout masks
themselves differ from Megatron's (SDPA draws its own), so equality under dropout is in
distribution, not bit for bit.

Features this forward does not cover (a non-vanilla softmax, sliding-window attention, an
attention bias, packed sequences) fall through to Megatron's own forward unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config as rope_mscale,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from attnres_dist.model.sequence_context import RotaryTables, rotary_tables


class SdpaAttention(DotProductAttention):
    """``DotProductAttention`` whose forward is one ``scaled_dot_product_attention`` call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Megatron divides softmax_scale by the layer number under query-key layer scaling and
        # multiplies the scores back in its softmax: the net scale is the undivided one.
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number
        self.sdpa_scale = scale
        self._megatron_only = self.softmax_offset is not None or self.config.window_size is not None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if self._megatron_only or attention_bias is not None or packed_seq_params is not None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        sq, b, heads, head_dim = query.shape
        # [s, b, n, hn] -> [b, n, s, hn]: a strided view, SDPA reads it in place
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask, causal = None, False
        if attention_mask is None:
            causal = self.attn_mask_type == AttnMaskType.causal and sq > 1
        else:
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attends
        p = self.attention_dropout.p if self.training else 0.0
        call = dict(attn_mask=mask, is_causal=causal, scale=self.sdpa_scale)
        call["enable_gqa"] = key.shape[2] != heads
        if (
            p > 0.0
            and self.config.tensor_model_parallel_size > 1
            and not self.config.sequence_parallel
        ):
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **call)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, **call)
        # [b, n, sq, hn] -> [sq, b, n * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


class SdpaSelfAttention(SelfAttention):
    """``SelfAttention`` whose rotary embedding is ``t * cos + roll(t, d/2) * sin_signed``.

    The same math as Megatron's non-interleaved ``t * cos + rotate_half(t) * sin`` with
    ``rotate_half(t) = [-t2, t1]``: ``roll`` gives ``[t2, t1]`` and the sign sits in the
    table. Applied where Megatron applies it (after the q/k projections and q/k norms, before
    core attention); everything else is Megatron's forward, which is passed no rotary
    embedding. Configurations this does not cover (interleaved or partial rotary, multi-latent
    attention, per-layer no-RoPE, inference, packed sequences) take Megatron's path unchanged.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        # rotates from the context's ``RotaryTables`` (``mscale``: their scale) where it can
        self.takes_tables = not (c.rotary_interleaved or c.multi_latent_attention or c.no_rope_freq)
        self.mscale = rope_mscale(c)
        self._rope: tuple | None = None  # (q tables, k tables) during one forward

    def forward(self, hidden_states, attention_mask=None, *args, rotary_pos_emb=None, **kwargs):
        """``rotary_pos_emb``: Megatron's angles, or the context's ``RotaryTables`` (the
        layer passes those where ``takes_tables``)."""
        fast = (
            self.takes_tables
            and rotary_pos_emb is not None
            and not args
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
            and kwargs.get("packed_seq_params") is None
        )
        if fast and not isinstance(rotary_pos_emb, RotaryTables):
            q_freqs, k_freqs = (
                rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            )
            head_dim = self.hidden_size_per_attention_head
            fast = q_freqs.shape[-1] == head_dim and k_freqs.shape[-1] == head_dim
            if fast:
                tables = [
                    rotary_tables(f, hidden_states.dtype, self.mscale) for f in (q_freqs, k_freqs)
                ]
                rotary_pos_emb = tables[0] if q_freqs is k_freqs else tuple(tables)
        if not fast:
            return super().forward(
                hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs
            )
        self._rope = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        try:
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=None, **kwargs)
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope is None:
            return out
        query, key, *rest = out
        q_tables, k_tables = self._rope
        return (_rotate(query, q_tables), _rotate(key, k_tables), *rest)


def _rotate(t: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotary embedding of ``t`` ``[s, b, heads, d]`` over its whole head dimension."""
    cos, sin = tables.cos.to(t.dtype), tables.sin.to(t.dtype)  # (no-ops where they match)
    return t * cos + t.roll(t.shape[-1] // 2, dims=-1) * sin
