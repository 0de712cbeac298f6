"""Per-sequence-length inputs every attention layer needs: causal mask and rotary embedding.

They depend only on the sequence length, head size and device, never on the data, so each stage
computes them locally (nothing about them crosses a pipeline boundary) and caches them.
The mask is always explicit: Megatron's implicit default mask is built on ``device="cuda"``.
With Megatron's document options (``model/document_masks.py``) ``with_layout`` replaces them by
per-sample ones: a ``[b, 1, s, s]`` mask and the rotary angles of each token's position id.
``is_plain_causal_mask`` recognises the plain causal masks built here, so a core attention
that has a causal fast path (``SdpaAttention``) can take it without reading the mask.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import lru_cache

import torch

# id -> causal mask built here, held weakly: an entry leaves when its mask does (lru eviction),
# so an id reused by a later tensor is never mistaken for a causal mask
_CAUSAL_MASKS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class SequenceContext:
    attention_mask: torch.Tensor  # [1 or b, 1, s, s] bool, True = masked (Megatron's convention)
    rotary_pos_emb: torch.Tensor  # [s, 1 or b, 1, head_dim]
    # the mask is the plain causal one built here (a core attention may run it as is_causal)
    causal: bool = False


def with_layout(ctx: SequenceContext, layout) -> SequenceContext:
    """``ctx`` with a ``DocumentLayout``'s per-sample positions (and mask, when it has one)."""
    if layout is None:
        return ctx
    table = ctx.rotary_pos_emb[:, 0, 0, :]  # [s, d]: angles of positions 0 .. s-1
    rotary = table[layout.position_ids].transpose(0, 1).unsqueeze(2)  # [s, b, 1, d]
    if layout.attention_mask is None:
        return SequenceContext(ctx.attention_mask, rotary, ctx.causal)
    return SequenceContext(layout.attention_mask, rotary)


def sequence_context(
    config,
    like: torch.Tensor,
    rotary_base: int,
    rope_scaling_factor: float | None = None,
    seq_dim: int = 0,
) -> SequenceContext:
    """Context for hidden states shaped like ``like`` ([s, b, h], Megatron's layout; or any
    tensor with the sequence in dimension ``seq_dim``, such as a depth store ``[c, s, b, h]``
    with ``seq_dim=1``, read without taking a view of one of its rows);
    ``rope_scaling_factor``: Llama 3's RoPE scaling (Megatron's), None = plain RoPE."""
    kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    seq_len = like.shape[seq_dim]
    return _cached(seq_len, kv_channels, rotary_base, rope_scaling_factor, str(like.device))


@lru_cache(maxsize=16)
def _cached(
    seq_len: int, kv_channels: int, rotary_base: int, scaling: float | None, device: str
) -> SequenceContext:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(
        kv_channels=kv_channels,
        rotary_percent=1.0,
        rotary_base=rotary_base,
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling or 8.0,
        use_cpu_initialization=True,
    )
    with torch.no_grad():
        emb = rope(seq_len).to(device)
        mask = torch.triu(torch.ones(seq_len, seq_len, device=device), diagonal=1).bool()
    mask = mask[None, None]
    _CAUSAL_MASKS[id(mask)] = mask
    return SequenceContext(mask, emb, causal=True)


def is_plain_causal_mask(mask: torch.Tensor) -> bool:
    """True if ``mask`` is a causal mask built by ``sequence_context`` (an identity check)."""
    return _CAUSAL_MASKS.get(id(mask)) is mask
