"""The next step's batches assembled in a background thread while this step runs.

A step's micro-batches are a pure function of the step (``GPTSamples.global_batch``): reading
them means indexing memory-mapped token files, where a page not yet in memory stalls the
reader on the disk, and on a GPU run copying them into pinned (page-locked) memory for a
queued host-to-device copy (``data/device_copy.py``). ``Prefetcher`` does both for step
``k + 1`` in one worker thread while the training loop runs step ``k`` (numpy's copies and
torch's pinning release the GIL), one step ahead, like a ``DataLoader`` with one worker and a
prefetch factor of one. The batches are the same, in the same order: only when they are built
changes. An error building a batch is raised by ``get`` of that step, in the training loop.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Prefetcher:
    """``fn(step)`` for the steps ``start .. stop - 1`` in order, each built one step ahead;
    ``pin``: the tensors returned in pinned memory (a CUDA run)."""

    def __init__(self, fn: Callable[[int], list[torch.Tensor]], start: int, stop: int, pin=False):
        self._fn, self._stop, self._pin = fn, stop, pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches")
        self._ahead: tuple[int, Future] | None = None
        self._submit(start)

    def _build(self, step: int) -> list[torch.Tensor]:
        batches = self._fn(step)
        return [t.pin_memory() for t in batches] if self._pin else batches

    def _submit(self, step: int) -> None:
        self._ahead = (step, self._pool.submit(self._build, step)) if step < self._stop else None

    def get(self, step: int) -> list[torch.Tensor]:
        """The batches of ``step``; starts building ``step + 1``."""
        if self._ahead is None or self._ahead[0] != step:  # not the step after the last one
            if self._ahead is not None:
                self._ahead[1].cancel()
            self._submit(step)
        future = self._ahead[1]
        self._submit(step + 1)
        return future.result()

    def close(self) -> None:
        """Drop what was built ahead and stop the thread."""
        if self._ahead is not None:
            self._ahead[1].cancel()
        self._pool.shutdown(wait=True)
