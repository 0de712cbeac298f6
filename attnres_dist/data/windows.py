"""Cutting a global batch of token windows into this data-parallel rank's micro-batches.

A global batch (``Samples.global_batch``, a pure function of the step) is the same on every
rank; each data-parallel rank takes its contiguous shard and cuts it into micro-batches, so
every layout trains on exactly the single-process run's samples.
"""

from __future__ import annotations

import torch

from attnres_dist.errors import ConfigError


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
