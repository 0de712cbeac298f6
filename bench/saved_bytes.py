"""Count the bytes autograd saves for backward, deduplicated by storage.

Owns :class:`SavedTensorCounter`, a context manager built on
``torch.autograd.graph.saved_tensors_hooks`` that records every tensor packed for
backward inside its scope (including tensors saved by custom autograd functions).
Bytes are counted per underlying storage, so a tensor saved by several ops, or
several views of one buffer, count once. ``extra_bytes(inputs)`` leaves out the
storages of given tensors: the memory an op adds on top of its own inputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor


def _storage_key(t: Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


@dataclass(frozen=True)
class SavedTensor:
    """One tensor as packed for backward."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    storage_key: tuple[str, int]
    storage_nbytes: int


class SavedTensorCounter:
    """Record the tensors autograd saves for backward while the context is active.

    The pack hook returns the tensor unchanged, so recording does not alter what
    is saved or how backward runs. Use one counter per forward pass under test.
    """

    def __init__(self) -> None:
        self.saved: list[SavedTensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> Tensor:
        self.saved.append(
            SavedTensor(
                shape=tuple(t.shape),
                dtype=t.dtype,
                numel=t.numel(),
                storage_key=_storage_key(t),
                storage_nbytes=t.untyped_storage().nbytes(),
            )
        )
        return t

    @staticmethod
    def _unpack(t: Tensor) -> Tensor:
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def storages(self) -> dict[tuple[str, int], int]:
        """Distinct storages saved, mapped to their size in bytes."""
        return {s.storage_key: s.storage_nbytes for s in self.saved}

    def total_bytes(self) -> int:
        """Bytes of all distinct storages saved for backward."""
        return sum(self.storages().values())

    def extra_bytes(self, inputs: Iterable[Tensor]) -> int:
        """Bytes of saved storages that are not the storage of any of ``inputs``."""
        exclude = {_storage_key(t) for t in inputs}
        return sum(b for k, b in self.storages().items() if k not in exclude)

    def extra_tensors(self, inputs: Iterable[Tensor]) -> list[SavedTensor]:
        """Saved tensors whose storage is not the storage of any of ``inputs``."""
        exclude = {_storage_key(t) for t in inputs}
        return [s for s in self.saved if s.storage_key not in exclude]
