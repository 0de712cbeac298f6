"""A tiny AttnRes GPT for single-process model tests, and the definitions it is checked on.

``build`` makes the model (3 layers x 32, 4 heads, 12 positions, random weights from ``seed``)
for a residual mode and block size (``build_selected``: from a config, on the runtime it
selects), ``randomize_mixers`` gives every depth-attention query and
key-norm gain non-trivial values (the initial zero queries mix uniformly). ``naive_sources`` and
``naive_sublayer`` are DESIGN.md section 2 written out: the sources sublayer ``i`` attends over
(the embedding, every completed block's sum, the partial block's sum), formed from scratch from
the sublayer outputs ``v``, and one sublayer's output from its input, with the model's own
Megatron submodules.
"""

from __future__ import annotations

import torch

from attnres_dist.config import load_config
from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
from attnres_dist.runtime.select import select_runtime

VOCAB = 257


def tiny_overrides(mode: str, block_size: int, num_layers: int, **extra) -> list[str]:
    return [
        f"model.num_layers={num_layers}",
        "model.hidden_size=32",
        "model.num_attention_heads=4",
        "model.seq_length=12",
        f"model.attnres.mode={mode}",
        f"model.attnres.block_size={block_size}",
    ] + [f"{k}={v}" for k, v in extra.items()]


def build(mode="block", block_size=2, num_layers=3, seed=0, **extra) -> AttnResGPT:
    """The model of the config with ``extra`` dotted overrides (recompute from the config)."""
    cfg = load_config(None, tiny_overrides(mode, block_size, num_layers, **extra))
    return AttnResGPT(
        ModelBuilder(cfg.model, VOCAB, seed=seed),
        cfg.parallel.recompute,
        cfg.parallel.recompute_interval,
    )


def build_selected(cfg, seed: int = 0) -> AttnResGPT:
    """The model of ``cfg`` on the runtime ``select_runtime`` picks for it, as the trainer
    builds it (compiled regions where ``runtime.compile`` says so), recompute from the config."""
    runtime = select_runtime(cfg.runtime, cfg.model.attnres.impl)
    return AttnResGPT(
        ModelBuilder(cfg.model, VOCAB, seed=seed, runtime=runtime),
        cfg.parallel.recompute,
        cfg.parallel.recompute_interval,
    )


def randomize_mixers(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mixer_weights"):  # [mixers, (query, key gain), D]
                noise = torch.randn(p.shape, generator=g)
                p[:, 0].copy_(noise[:, 0] * 0.5)
                p[:, 1].copy_(noise[:, 1] * 0.2 + 1.0)


def naive_sources(v: list, i: int, size: int) -> list:
    """What sublayer ``i`` (1-based) attends over, given the outputs ``v = [v_0, .., v_{i-1}]``
    and the block size: ``v_0``, each completed block's sum, the partial block's sum if any."""
    done = (i - 1) // size  # blocks completed before sublayer i
    blocks = [v[0]] + [sum(v[1 + n * size : 1 + (n + 1) * size]) for n in range(done)]
    partial = v[1 + done * size : i]
    return blocks + ([sum(partial)] if partial else [])


def naive_sublayer(m, ctx, x, attention: bool):
    """The output of transformer layer ``m``'s attention or MLP sublayer on input ``x``."""
    if attention:
        out, _ = m.self_attention(
            m.input_layernorm(x),
            attention_mask=ctx.attention_mask,
            rotary_pos_emb=ctx.rotary_pos_emb,
        )
    else:
        out, _ = m.mlp(m.pre_mlp_layernorm(x))
    return out
