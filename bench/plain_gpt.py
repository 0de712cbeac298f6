"""A plain-PyTorch GPT: the yardstick the Megatron-layer model's throughput is measured against.

Self-contained and deliberately ordinary: pre-norm residual blocks with RMSNorm, rotary
position embeddings, causal ``scaled_dot_product_attention``, a SwiGLU MLP, no biases, tied
input/output embeddings, fp32. Shapes follow a ``ModelConfig`` (hidden size, heads, query
groups, SwiGLU width, sequence length) so that it is the same size as the project's model;
it shares no code with it. Only the model benchmark (``model_bench``) uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(seq: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[seq, head_dim]`` for the non-interleaved (rotate-half) convention."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, heads, s, d]``: rotate each position's pairs (i, i + d/2)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, groups: int, ffn: int, eps: float):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * self.head_dim, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim],
            dim=-1,
        )
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.groups, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.groups != self.heads
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainGPT(nn.Module):
    """Token ids ``[b, s]`` -> logits ``[b, s, vocab]``; ``loss(window)`` as the project's."""

    def __init__(self, model, vocab_size: int):
        super().__init__()
        hidden, heads = model.hidden_size, model.num_attention_heads
        groups = model.num_query_groups or heads
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, groups, model.ffn_size, model.norm_eps)
            for _ in range(model.num_layers)
        )
        self.norm = nn.RMSNorm(hidden, eps=model.norm_eps)
        cos, sin = rope_tables(model.seq_length, hidden // heads, model.rotary_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=model.init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.cos[:s], self.sin[:s]
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.embed.weight)  # tied output embedding

    def loss(self, window: torch.Tensor) -> torch.Tensor:
        logits = self(window[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
