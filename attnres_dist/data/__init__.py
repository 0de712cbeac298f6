"""Data: tokenizers, on-disk indexed datasets, the default stdlib corpus, Megatron samples.

    prefix = ensure_default_corpus(".cache/data")      # or prepare_dataset(files, prefix, tok)
    train, valid, meta = open_dataset(prefix, seq_length=256, vocab_size=257, seed=0)
    batch = train.global_batch(step, batch_size=16)    # [16, 257] LongTensor
    micro = split_micro_batches(batch, micro_batch_size=4, dp_rank=0, dp_size=2)

Names are resolved on first access, so ``from attnres_dist.data import prepare_cmd`` (done by
the CLI to build its parser) imports neither torch nor megatron-core.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
    "ensure_default_corpus": "stdlib_corpus",
    "prepare_dataset": "prepare",
    "Samples": "gpt_samples",
    "open_dataset": "gpt_samples",
    "split_micro_batches": "windows",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
