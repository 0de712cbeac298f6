"""Per-sequence-length inputs every attention layer needs: causal mask and rotary embedding.

They depend only on the sequence length, head size and device, never on the data, so each stage
computes them locally (nothing about them crosses a pipeline boundary) and caches them.
The mask is always explicit: Megatron's implicit default mask is built on ``device="cuda"``.
With Megatron's document options (``model/document_masks.py``) ``with_layout`` replaces them by
per-sample ones: a ``[b, 1, s, s]`` mask and the rotary angles of each token's position id.
``SequenceContext.causal`` says the mask is the plain causal one, so a core attention with a
causal fast path (``SdpaAttention``) is passed no mask and takes it. For ``SdpaSelfAttention``
the context also holds the rotary cos / signed-sin tables in the activations' dtype
(``rotary_tables``), made once per length, dtype and scale with the rest of it: every layer
and step reads the same tables, and a compiled layer takes them as inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True, eq=False)  # one object per length (and dtype): told apart by identity
class SequenceContext:
    attention_mask: torch.Tensor  # [1 or b, 1, s, s] bool, True = masked (Megatron's convention)
    rotary_pos_emb: torch.Tensor  # [s, 1 or b, 1, head_dim]
    # the mask is the plain causal one built here (a core attention may run it as is_causal)
    causal: bool = False
    tables: RotaryTables | None = None  # where asked for (``mscale``)


@dataclass(frozen=True)
class RotaryTables:
    """``rotary_tables`` of the context's angles: what ``SdpaSelfAttention`` rotates with."""

    cos: torch.Tensor  # [s, 1 or b, 1, d]
    sin: torch.Tensor  # the same, its first half negated


def rotary_tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float) -> RotaryTables:
    """cos and signed sin of Megatron's rotary angles ``freqs`` (rotate-half layout), times
    ``mscale``, in ``dtype``: ``t * cos + roll(t, d / 2) * sin`` is Megatron's
    ``t * cos + rotate_half(t) * sin``."""
    cos = torch.cos(freqs) * mscale
    sin = torch.sin(freqs) * mscale
    half = freqs.shape[-1] // 2
    sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return RotaryTables(cos.to(dtype), sin.to(dtype))


def with_layout(ctx: SequenceContext, layout) -> SequenceContext:
    """``ctx`` with a ``DocumentLayout``'s per-sample positions (and mask, when it has one)."""
    if layout is None:
        return ctx

    def per_sample(table):  # [s, 1, 1, d] of positions 0 .. s-1 -> [s, b, 1, d]
        return table[:, 0, 0, :][layout.position_ids].transpose(0, 1).unsqueeze(2)

    rotary = per_sample(ctx.rotary_pos_emb)
    tables = ctx.tables
    if tables is not None:
        tables = RotaryTables(per_sample(tables.cos), per_sample(tables.sin))
    if layout.attention_mask is None:
        return SequenceContext(ctx.attention_mask, rotary, ctx.causal, tables)
    return SequenceContext(layout.attention_mask, rotary, tables=tables)


def sequence_context(
    config,
    like: torch.Tensor,
    rotary_base: int,
    rope_scaling_factor: float | None = None,
    seq_dim: int = 0,
    mscale: float | None = None,
) -> SequenceContext:
    """Context for hidden states shaped like ``like`` ([s, b, h], Megatron's layout; or any
    tensor with the sequence in dimension ``seq_dim``, such as a depth store ``[c, s, b, h]``
    with ``seq_dim=1``, read without taking a view of one of its rows);
    ``rope_scaling_factor``: Llama 3's RoPE scaling (Megatron's), None = plain RoPE;
    ``mscale``: the rotary tables' scale, None = no tables."""
    kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
    seq_len = like.shape[seq_dim]
    if config.sequence_parallel:  # the attention gathers the tensor ranks' sequence splits
        seq_len *= config.tensor_model_parallel_size
    ctx = _cached(seq_len, kv_channels, rotary_base, rope_scaling_factor, str(like.device))
    if mscale is None:
        return ctx
    return _with_tables(ctx, like.dtype, mscale)


@lru_cache(maxsize=16)
def _with_tables(ctx: SequenceContext, dtype: torch.dtype, mscale: float) -> SequenceContext:
    with torch.no_grad():
        tables = rotary_tables(ctx.rotary_pos_emb, dtype, mscale)
    return SequenceContext(ctx.attention_mask, ctx.rotary_pos_emb, ctx.causal, tables)


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
    return SequenceContext(mask, emb, causal=True)
