"""The rows a micro-batch's block store grows into, and their gradient.

The store grows into a preallocated buffer (``StoreBuffer``: ``capacity`` rows, fixed by the
block plan for the layers that will run on it): closing a block writes one row, so a forward
pass copies each block once. Each store the model sees is a separate tensor aliasing the
buffer's leading rows (``_alias``), with its own version counter: writing row ``c`` does not
invalidate a smaller store that an autograd node saved (those rows never change), which a view
of the buffer would.

In backward the buffer also holds the rows' gradient, one ``[capacity, s, b, h]`` tensor: a
reader that can (the fused phase-1 kernel) adds its share there directly, and ``_WriteRows`` adds
what reached its store through autograd (any other reader, a later stage) and hands the row it
appended its finished gradient, for every reader of a row ran after it in forward. Without
this, every store of a pass would get a gradient tensor of its own and autograd would add them
prefix by prefix: traffic quadratic in the number of blocks.

``write_rows`` (``_WriteRows``) is the one maker of every store: an append, a received payload
adopted into a buffer, a stage's input assembled from cached and received blocks
(``model/depth_state.py``).
"""

from __future__ import annotations

import torch


def _alias(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``buffer`` as a fresh tensor (not a view, own version counter)."""
    out = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    return out.set_(buffer.untyped_storage(), 0, (rows, *buffer.shape[1:]), buffer.stride())


def _alias_row(buffer: torch.Tensor, row: int) -> torch.Tensor:
    """Row ``row`` of ``buffer`` as a fresh tensor (not a view, own version counter)."""
    out = torch.empty(0, dtype=buffer.dtype, device=buffer.device)
    offset = buffer.storage_offset() + row * buffer.stride(0)
    return out.set_(buffer.untyped_storage(), offset, buffer.shape[1:], buffer.stride()[1:])


def _is_prefix_of(store: torch.Tensor, buffer: torch.Tensor) -> bool:
    return (
        store.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and store.storage_offset() == 0
        and store.stride() == buffer.stride()
        and store.dtype == buffer.dtype
    )


class StoreBuffer:
    """The rows a micro-batch's store grows into, and (lazily, in backward) their gradient.

    The gradient is allocated uninitialised; a row is written in full by its first writer when
    that writer can (a kernel told ``accumulate=False`` by :meth:`grad_rows`), else zeroed and
    added into. The first writer is usually the final aggregation's phase 1, which covers every
    row: then no row is zero-filled (docs/kernels.md gives the sizes spared).
    """

    __slots__ = ("data", "_grad", "_unset")

    def __init__(self, data: torch.Tensor):
        self.data = data
        self._grad: torch.Tensor | None = None
        self._unset: list[bool] = []  # rows of _grad holding no value yet

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    def holds(self, store: torch.Tensor) -> bool:
        """Whether ``store`` is this buffer's leading rows (an alias, not a copy)."""
        return _is_prefix_of(store, self.data)

    def grad(self, rows: int | None = None) -> torch.Tensor:
        """The rows' gradient so far, its first ``rows`` rows (all: None) holding values (zeros
        where nothing was added yet)."""
        self._set(0, self.capacity if rows is None else rows)
        return self._grad

    def grad_span(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of the gradient so far (zeros where nothing was added yet)."""
        self._set(lo, hi)
        return self._grad[lo:hi]

    def grad_rows(self, lo: int, hi: int) -> tuple[torch.Tensor, bool]:
        """(rows ``lo:hi`` of the gradient, accumulate). accumulate False: no value is in them
        yet and the caller must write every element; True: add into them."""
        self._allocate()
        if all(self._unset[lo:hi]):
            self._unset[lo:hi] = [False] * (hi - lo)
            return self._grad[lo:hi], False
        self._set(lo, hi)
        return self._grad[lo:hi], True

    def add_grad(self, grad: torch.Tensor, start: int = 0) -> None:
        """Add ``grad`` (a gradient of rows ``start ..`` that reached a store or a row through
        autograd) to the rows' gradient, writing the rows that hold none yet."""
        rows, accumulate = self.grad_rows(start, start + grad.shape[0])
        rows.add_(grad) if accumulate else rows.copy_(grad)

    def _allocate(self) -> None:
        """The gradient, uninitialised, every row unset (once)."""
        if self._grad is None:
            self._grad = torch.empty_like(self.data)
            self._unset = [True] * self.capacity

    def _set(self, lo: int, hi: int) -> None:
        """Zero the rows of ``lo:hi`` that hold no value yet, one fill per run of them."""
        self._allocate()
        i = lo
        while i < hi:
            if not self._unset[i]:
                i += 1
                continue
            j = i
            while j < hi and self._unset[j]:
                j += 1
            self._grad[i:j].zero_()
            self._unset[i:j] = [False] * (j - i)
            i = j


class _WriteRows(torch.autograd.Function):
    """``pieces`` (each ``[k, s, b, h]``) written one after the other into ``buffer``'s rows,
    from the end of ``store`` on, ``addend`` (or None) added to the last piece on the way (a
    Block block closes as ``partial + out`` written straight into its row, where the sum
    would be formed, then copied). ``store`` is None or the alias of the buffer's leading
    rows, which already hold its values. Returns the alias of every row written so far and
    the alias of the last one (a closed block, for a phase 2 that merges it).

    This is the one place a store is made: an append, a received payload adopted into a
    buffer, a stage's input assembled from cached and received blocks.

    Backward: the rows' gradient gathers in the buffer (readers that can add theirs there
    directly; what reached either output through autograd is added to it), and each piece
    gets its rows of it: every reader of those rows read this alias or a later one, so they
    have all run. ``store`` gets none: its rows' gradient stays in the buffer for the function
    that wrote them, which runs its backward after this one (``store`` is an input for that
    order). Only the pieces' rows are read: filling the others would zero rows that a later
    reader writes in full."""

    @staticmethod
    def forward(ctx, buffer: StoreBuffer, store, addend, *pieces):
        lo = 0 if store is None else store.shape[0]
        spans = []
        for piece in pieces:
            hi = lo + piece.shape[0]
            spans.append((lo, hi))
            lo = hi
        for (lo, hi), piece in zip(spans[:-1], pieces[:-1], strict=True):
            buffer.data[lo:hi].copy_(piece)
        lo, hi = spans[-1]
        if addend is None:
            buffer.data[lo:hi].copy_(pieces[-1])
        else:
            torch.add(pieces[-1], addend, out=buffer.data[lo:hi])
        ctx.spans, ctx.buffer = spans, buffer
        ctx.set_materialize_grads(False)
        return _alias(buffer.data, hi), _alias_row(buffer.data, hi - 1)

    @staticmethod
    def backward(ctx, grad, grad_row):
        buffer, end = ctx.buffer, ctx.spans[-1][1]
        if grad is not None:  # readers that returned their gradient through autograd
            buffer.add_grad(grad)
        if grad_row is not None:
            buffer.add_grad(grad_row.unsqueeze(0), end - 1)
        grads = [buffer.grad_span(lo, hi) for lo, hi in ctx.spans]
        grad_addend = grads[-1].squeeze(0) if ctx.needs_input_grad[2] else None
        return None, None, grad_addend, *grads


def write_rows(
    buffer: StoreBuffer,
    store: torch.Tensor | None,
    pieces: list[torch.Tensor],
    addend: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the store with ``pieces`` written after ``store``'s rows, its last row): see
    ``_WriteRows``."""
    return _WriteRows.apply(buffer, store, addend, *pieces)
