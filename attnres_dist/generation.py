"""Autoregressive sampling: one sampling rule, two ways to get the next token's logits.

* ``CachedDecoder`` runs the Hugging Face model (``attnres_dist/hf/modeling_attnres.py``, the
  code shipped in every ``--format hf`` export) with a transformers ``DynamicCache``: the
  prompt is one forward, then each new token one single-position forward. Only the
  self-attention keys and values are cached; the depth-attention state is per token and is
  rebuilt inside each forward, so nothing else needs keeping.
* ``RecomputeWindow`` runs any model on the whole window for every token (the reference).

Within the training window (prompt + new tokens <= ``seq_length``) both see every token at
the positions it was trained with, so greedy decoding gives the same tokens. Past the window
``RecomputeWindow`` slides one token at a time (positions restart at 0 for every window);
``CachedDecoder`` keeps positions inside the trained range by dropping its cache once the
window is full and re-reading the newest ``seq_length // 2`` tokens: the model then always
sees between half a window and a whole window of context, at the cost of one short prefill
every ``seq_length // 2`` tokens.

Sampling (``sample_token``): temperature 0 is greedy (argmax); otherwise logits / temperature,
top-k (0 = all tokens), and one draw from a seeded ``torch.Generator``. Generation stops at
the end-of-document token, which is never part of the returned ids.
"""

from __future__ import annotations

import torch


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, generator) -> int:
    """One token id from 1-D ``logits`` over the tokenizer's vocabulary."""
    logits = logits.float()
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


class RecomputeWindow:
    """Next-token logits from a full forward over the last ``seq_length`` ids.

    ``forward(tokens [1, s]) -> logits of the last position`` adapts the model."""

    def __init__(self, forward, seq_length: int, device):
        self.forward, self.seq_length, self.device = forward, seq_length, device

    def __call__(self, ids: list[int]) -> torch.Tensor:
        tokens = torch.tensor([ids[-self.seq_length :]], dtype=torch.long, device=self.device)
        return self.forward(tokens)


class CachedDecoder:
    """Next-token logits from a Hugging Face causal LM with a ``DynamicCache``."""

    def __init__(self, model, seq_length: int):
        self.model, self.seq_length = model, seq_length
        self.device = next(model.parameters()).device
        self.cache = None
        self.start = self.cached = 0  # the cache holds ids[start:cached]
        self.prefills = 0

    def __call__(self, ids: list[int]) -> torch.Tensor:
        from transformers import DynamicCache

        if self.cache is None or len(ids) > self.start + self.seq_length:
            keep = self.seq_length if self.cache is None else self.seq_length // 2
            self.cache, self.start = DynamicCache(), max(0, len(ids) - keep)
            self.cached = self.start
            self.prefills += 1
        tokens = torch.tensor([ids[self.cached :]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=tokens, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.cached = len(ids)
        return out.logits[0, -1]


def hf_forward(model):
    """``RecomputeWindow`` adapter for a Hugging Face model (no cache)."""
    return lambda tokens: model(input_ids=tokens, use_cache=False).logits[0, -1]


def native_forward(model):
    """``RecomputeWindow`` adapter for ``AttnResGPT`` (logits ``[s, b, v]``)."""
    return lambda tokens: model(tokens)[-1, 0]


def sample(
    next_logits,
    ids: list[int],
    vocab_size: int,
    eod: int,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> list[int]:
    """The new ids after ``ids`` (stops before the end-of-document token)."""
    generator = torch.Generator().manual_seed(seed)
    ids, new = list(ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = next_logits(ids)[:vocab_size]
            token = sample_token(logits, temperature, top_k, generator)
            if token == eod:
                break
            ids.append(token)
            new.append(token)
    return new
