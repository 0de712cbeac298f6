"""Training samples: fixed-length token windows over a split, and deterministic batching.

A split is read as one memory-mapped token stream (documents back to back, each ending in EOD)
and cut into non-overlapping windows of ``seq_length + 1`` tokens with stride ``seq_length``:
inputs are ``w[:-1]``, labels ``w[1:]``, so every token of the stream is predicted exactly once.

``global_batch(step, batch_size, seed)`` depends on nothing but its arguments (no iterator
state), which is what lets data-parallel and pipelined runs see exactly the batches of the
single-process run and lets a resumed run continue exactly where it stopped.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from attnres_dist.data import indexed
from attnres_dist.errors import ConfigError, DataError


class TokenWindows:
    """Non-overlapping ``seq_length + 1``-token windows of one split (an ``IndexedDataset``
    or the path prefix of its ``.bin``/``.idx`` pair)."""

    def __init__(self, indexed_dataset_or_prefix, seq_length: int):
        if isinstance(indexed_dataset_or_prefix, str | os.PathLike):
            dataset = indexed.open_indexed(os.fspath(indexed_dataset_or_prefix))
        else:
            dataset = indexed_dataset_or_prefix
        if int(seq_length) < 1:
            raise ConfigError("model.seq_length", f"got {seq_length}; must be >= 1")
        self.seq_length = int(seq_length)
        self.path = dataset.path_prefix
        dtype = np.dtype(dataset.index.dtype)
        self.num_tokens = int(dataset.sequence_lengths.sum(dtype=np.int64))
        # Map the .bin file directly rather than through the dataset's reader: a dataset opened
        # with mmap=False would otherwise read the whole split into memory.
        self._stream = np.memmap(
            self.path + ".bin", dtype=dtype, mode="r", shape=(self.num_tokens,)
        )
        self._num_windows = (self.num_tokens - 1) // self.seq_length
        if self._num_windows < 1:
            raise DataError(
                self.path,
                f"{self.num_tokens} tokens is too few for one window of seq_length + 1 = "
                f"{self.seq_length + 1} tokens; use a shorter model.seq_length or more data",
            )
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self._num_windows

    def window(self, i: int) -> np.ndarray:
        """Window ``i`` as an int64 array of ``seq_length + 1`` tokens."""
        if not 0 <= i < self._num_windows:
            raise IndexError(f"window {i} out of range [0, {self._num_windows})")
        start = i * self.seq_length
        return np.asarray(self._stream[start : start + self.seq_length + 1], dtype=np.int64)

    def _gather(self, window_ids: np.ndarray) -> torch.Tensor:
        offsets = window_ids[:, None] * self.seq_length + np.arange(self.seq_length + 1)
        return torch.from_numpy(self._stream[offsets].astype(np.int64))

    def _permutation(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = np.random.default_rng([seed, epoch]).permutation(self._num_windows)
            # A batch touches at most the current and the next epoch in normal use.
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = perm
        return perm

    def global_batch(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """The ``[batch_size, seq_length + 1]`` LongTensor of optimizer step ``step``.

        Windows are taken in the order of a permutation seeded by ``(seed, epoch)``; step ``s``
        takes positions ``s * batch_size ...`` of the endless sequence of epochs, so a batch may
        straddle an epoch boundary. A pure function of its arguments.
        """
        if step < 0 or batch_size < 1 or seed < 0:
            raise ValueError(
                f"need step >= 0, batch_size >= 1, seed >= 0; got {step, batch_size, seed}"
            )
        positions = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
        epochs, within = np.divmod(positions, self._num_windows)
        window_ids = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            window_ids[mask] = self._permutation(seed, int(epoch))[within[mask]]
        return self._gather(window_ids)

    def eval_batches(self, num_batches: int, batch_size: int) -> list[torch.Tensor]:
        """The first ``num_batches * batch_size`` windows in order, as ``batch_size`` batches.

        A fixed validation set. When the split holds fewer windows, only the full batches that
        fit are returned (with a warning); fewer than one full batch is an error.
        """
        available = self._num_windows // batch_size
        if available < 1:
            raise DataError(
                self.path,
                f"{self._num_windows} windows of {self.seq_length + 1} tokens, fewer than one "
                f"evaluation batch of {batch_size}; use more validation data, a shorter "
                "model.seq_length or a smaller micro batch",
            )
        if available < num_batches:
            warnings.warn(
                f"{self.path}: only {available} of {num_batches} evaluation batches fit",
                stacklevel=2,
            )
        ids = np.arange(min(num_batches, available) * batch_size, dtype=np.int64)
        return list(self._gather(ids).split(batch_size))

    def __repr__(self) -> str:
        return (
            f"TokenWindows({self.path!r}, seq_length={self.seq_length}, "
            f"tokens={self.num_tokens}, windows={self._num_windows})"
        )


def split_micro_batches(
    global_batch: torch.Tensor, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s micro batches: its contiguous shard of the global batch,
    cut into ``micro_batch_size`` rows each. Concatenating every rank's micro batches in rank
    order gives back the global batch."""
    rows = int(global_batch.shape[0])
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    if micro_batch_size < 1 or rows % (micro_batch_size * dp_size):
        raise ConfigError(
            "train.global_batch_size",
            f"got {rows}; must be a multiple of micro_batch_size ({micro_batch_size}) x "
            f"data-parallel size ({dp_size})",
        )
    shard = rows // dp_size
    mine = global_batch[dp_rank * shard : (dp_rank + 1) * shard]
    return list(mine.split(micro_batch_size))


def open_dataset(
    prefix: str, seq_length: int, vocab_size: int | None = None
) -> tuple[TokenWindows, TokenWindows, dict]:
    """(train windows, valid windows, metadata) of the dataset at ``prefix``.

    ``vocab_size`` is the model's; every token id in the data must be below it (``None`` or 0:
    the tokenizer's vocabulary size from the metadata).
    """
    train, valid, meta = indexed.load_dataset(os.fspath(prefix), vocab_size)
    return TokenWindows(train, seq_length), TokenWindows(valid, seq_length), meta
