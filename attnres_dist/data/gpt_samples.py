"""Training samples from megatron-core's own dataset machinery, and deterministic batching.

``open_samples`` hands the run's data options to ``BlendedMegatronDatasetBuilder`` with
``GPTDataset``: Megatron shuffles the documents, cuts the shuffled stream into
``seq_length + 1``-token samples (consecutive samples share one token), shuffles the samples and,
for a blend, interleaves the datasets by weight (``BlendedDataset``). Its index files are cached
in ``<data.cache_dir>/indices`` and reused by every later run with the same options.

Two kinds of prefix:

* without ``data.split``, a prefix is a ``prepare-data`` dataset (``P.meta.json``, ``P_train``,
  ``P_valid``): training blends the ``_train`` files, validation the ``_valid`` files
  (Megatron's per-split blends);
* with ``data.split`` (``"969,30,1"``), a prefix is one Megatron indexed dataset (``P.bin`` /
  ``P.idx``, e.g. from Megatron's ``preprocess_data.py``) whose documents are split by it, and
  the tokenizer comes from ``data.tokenizer``.

``Samples.global_batch(step, size)`` is sample ``step * size`` onwards: a pure function of the
step, so every layout and a resumed run see the same batches. The training split is built for
``train.steps * train.global_batch_size`` samples, as Megatron builds it for its ``train_iters``:
changing ``train.steps`` may change which samples later steps see.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from attnres_dist.data import indexed
from attnres_dist.data.blend import Blend, parse_blend, parse_split
from attnres_dist.errors import DataError


class MegatronTokenizerInfo:
    """What GPTDataset needs of a tokenizer: the EOD id, the vocabulary size, and identifiers
    for its cache key. It has no ``pad``, so Megatron pads with -1 and masks nothing."""

    def __init__(self, kind: str, vocab_size: int, eod: int):
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)
        self.unique_identifiers = collections.OrderedDict(
            kind=kind, vocab_size=self.vocab_size, eod=self.eod
        )


class Samples:
    """Sample ``i`` of a Megatron GPT or blended dataset as a ``seq_length + 1`` token window."""

    def __init__(self, dataset, seq_length: int, name: str):
        self.dataset = dataset
        self.seq_length = int(seq_length)
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def window(self, i: int) -> torch.Tensor:
        item = self.dataset[int(i)]
        return torch.cat([item["tokens"], item["labels"][-1:]])

    def batch(self, ids) -> torch.Tensor:
        return torch.stack([self.window(i) for i in ids])

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The ``[batch_size, seq_length + 1]`` LongTensor of optimizer step ``step``."""
        start = step * batch_size
        if step < 0 or batch_size < 1 or start + batch_size > len(self):
            raise ValueError(
                f"step {step} x batch {batch_size} is outside the {len(self)} samples built"
            )
        return self.batch(range(start, start + batch_size))

    def eval_batches(self, num_batches: int, batch_size: int) -> list[torch.Tensor]:
        """``num_batches`` batches of samples spread evenly over the whole split.

        A fixed validation set, the same for every layout. When the split holds fewer samples,
        only the full batches that fit are returned (with a warning); fewer than one full batch
        is an error.
        """
        n = len(self)
        available = n // batch_size
        if available < 1:
            raise DataError(
                self.name,
                f"{n} samples of {self.seq_length + 1} tokens, fewer than one evaluation batch "
                f"of {batch_size}; use more validation data, a shorter model.seq_length or a "
                "smaller micro batch",
            )
        if available < num_batches:
            warnings.warn(
                f"{self.name}: only {available} of {num_batches} evaluation batches fit",
                stacklevel=2,
            )
        count = min(num_batches, available) * batch_size
        ids = (np.arange(count, dtype=np.int64) * n) // count
        return list(self.batch(ids).split(batch_size))

    def __repr__(self) -> str:
        return f"Samples({self.name!r}, seq_length={self.seq_length}, samples={len(self)})"


@dataclass(frozen=True)
class DataPlan:
    """The resolved data options: what the builder is given, plus the run's metadata."""

    blend: Blend
    split: tuple[float, float, float] | None
    meta: dict  # tokenizer, vocab_size, eod, max_token_id (what checkpoints and checks read)


def _raw_meta(prefix: str, tokenizer) -> dict:
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise DataError(
                prefix + ext,
                "file not found; with data.split each prefix names one Megatron indexed dataset "
                "(PREFIX.bin and PREFIX.idx)",
            )
    dataset = indexed.open_indexed(prefix)
    top = 0
    stream = np.memmap(prefix + ".bin", dtype=np.dtype(dataset.index.dtype), mode="r")
    for start in range(0, stream.size, 1 << 24):  # bounded memory on large files
        top = max(top, int(stream[start : start + (1 << 24)].max()))
    return {
        "tokenizer": tokenizer.name,
        "tokenizer_path": os.path.abspath(tokenizer.path) if tokenizer.path else None,
        "vocab_size": int(tokenizer.vocab_size),
        "eod": int(tokenizer.eod),
        "max_token_id": top,
    }


def _merge_meta(metas: list[tuple[str, dict]]) -> dict:
    first_prefix, first = metas[0]
    for prefix, meta in metas[1:]:
        for key in ("tokenizer", "vocab_size", "eod"):
            if meta.get(key) != first.get(key):
                raise DataError(
                    prefix,
                    f"{key} {meta.get(key)!r} differs from {first_prefix}'s {first.get(key)!r}; "
                    "a blend needs datasets written with one tokenizer",
                )
    merged = dict(first)
    merged["max_token_id"] = max(int(m["max_token_id"]) for _, m in metas)
    merged["blend"] = [p for p, _ in metas]
    return merged


def plan_data(data_cfg, default_prefix: str | None = None) -> DataPlan:
    """Check every prefix of the configured data (files, metadata, one tokenizer) and return the
    plan. ``default_prefix`` is used when neither ``data.path`` nor ``data.paths`` is set."""
    from attnres_dist.data.tokenizer import build_tokenizer

    if data_cfg.paths:
        blend = parse_blend(data_cfg.paths)
    else:
        blend = Blend((data_cfg.path or default_prefix,), None)
    split = parse_split(data_cfg.split) if data_cfg.split else None
    metas = []
    if split is None:
        for prefix in blend.prefixes:
            meta = indexed.read_metadata(prefix)
            for s in indexed.SPLITS:
                indexed.open_split(prefix, s, meta)
            metas.append((prefix, meta))
    else:
        tokenizer = build_tokenizer(data_cfg.tokenizer, data_cfg.tokenizer_path)
        metas = [(prefix, _raw_meta(prefix, tokenizer)) for prefix in blend.prefixes]
    return DataPlan(blend, split, _merge_meta(metas))


@contextlib.contextmanager
def _rank_zero_without_process_group():
    """megatron-core 0.16.1's BlendedDataset asks ``torch.distributed.get_rank()`` on a cache
    miss even when no process group exists (GPTDataset checks first). Samples are opened before
    the process groups start, one process at a time (the lock): each process is rank 0 then."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    real = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = real


@contextlib.contextmanager
def _one_builder_at_a_time(cache_dir: str):
    """Ranks open the data before any process group exists: a file lock lets one build the
    index files while the others wait and then load them. Once a process group exists (a
    process that builds several trainers), megatron-core's builder orders the ranks itself with
    a barrier (rank 0 first), and holding the lock across that barrier would deadlock."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with open(os.path.join(cache_dir, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _blend_for(plan: DataPlan, suffix: str | None):
    prefixes = [
        p if suffix is None else indexed.split_prefix(p, suffix) for p in plan.blend.prefixes
    ]
    return prefixes, None if plan.blend.weights is None else list(plan.blend.weights)


def open_samples(
    plan: DataPlan,
    seq_length: int,
    seed: int,
    train_samples: int,
    eval_samples: int,
    cache_dir: str,
) -> tuple[Samples, Samples, Samples | None]:
    """(train, valid, test or None) samples of ``plan``, built (or loaded) by megatron-core.

    Validation and test splits are one epoch of their data (all of it, drawn evenly by
    ``eval_batches``) unless a weighted blend needs a size, then ``eval_samples``.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    meta = plan.meta
    tokenizer = MegatronTokenizerInfo(meta["tokenizer"], meta["vocab_size"], meta["eod"])
    weighted = plan.blend.weights is not None
    held_out = eval_samples if weighted else None
    common = dict(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        path_to_cache=os.path.join(os.path.abspath(cache_dir), "indices"),
        tokenizer=tokenizer,
        # Only the tokens are taken from a sample: the model derives masks and positions from
        # them with Megatron's rules (model/document_masks.py), on every stage that needs them.
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    if plan.split is None:
        config = GPTDatasetConfig(
            blend_per_split=[_blend_for(plan, "train"), _blend_for(plan, "valid"), None],
            **common,
        )
        sizes = [train_samples, held_out, None]
    else:
        config = GPTDatasetConfig(
            blend=_blend_for(plan, None), split=",".join(repr(v) for v in plan.split), **common
        )
        sizes = [train_samples, held_out, held_out if plan.split[2] > 0 else None]
    os.makedirs(config.path_to_cache, exist_ok=True)
    with _one_builder_at_a_time(config.path_to_cache):
        try:
            with _rank_zero_without_process_group():
                builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
                built = builder.build()
        except (AssertionError, ValueError, IndexError) as exc:
            raise DataError(
                ", ".join(plan.blend.prefixes),
                f"megatron-core could not build samples ({exc or 'assertion failed'}); "
                "use more data or a shorter model.seq_length",
            ) from None
    names = ("train", "valid", "test")
    out = []
    for name, dataset in zip(names, built, strict=True):
        if dataset is None or len(dataset) == 0:
            if name == "test":
                out.append(None)
                continue
            raise DataError(
                ", ".join(plan.blend.prefixes),
                f"the {name} split has no sample of {seq_length + 1} tokens; use more data, a "
                "larger share in data.split or a shorter model.seq_length",
            )
        out.append(
            Samples(dataset, seq_length, f"{name} samples of {', '.join(plan.blend.prefixes)}")
        )
    if train_samples is not None and len(out[0]) < train_samples:
        raise DataError(out[0].name, f"{len(out[0])} samples built, {train_samples} needed")
    return tuple(out)


def open_dataset(
    prefix: str,
    seq_length: int,
    vocab_size: int | None = None,
    seed: int = 0,
    train_samples: int | None = None,
    cache_dir: str | None = None,
) -> tuple[Samples, Samples, dict]:
    """(train, valid, metadata) of the ``prepare-data`` dataset at ``prefix``: one epoch of
    each split unless ``train_samples`` asks for more. ``vocab_size`` is the model's (None:
    the tokenizer's); the index files go to ``cache_dir`` (default: beside the dataset)."""
    prefix = os.fspath(prefix)
    meta = indexed.read_metadata(prefix)
    indexed.check_vocab(prefix, meta, int(vocab_size) if vocab_size else int(meta["vocab_size"]))
    plan = DataPlan(Blend((prefix,), None), None, meta)
    for split in indexed.SPLITS:
        indexed.open_split(prefix, split, meta)
    cache = cache_dir or os.path.dirname(os.path.abspath(prefix))
    train, valid, _ = open_samples(plan, seq_length, seed, train_samples, 1, cache)
    return train, valid, meta
