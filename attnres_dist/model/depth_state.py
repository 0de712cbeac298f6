"""The depth-attention state that flows from layer to layer within one forward pass.

``DepthState`` holds the completed block representations (``b_0`` = embedding first) as ONE
tensor, the *store* ``[c, s, b, h]``, so that attention over the completed blocks is one
batched read and a stage boundary sends the store plus the partial block; the partial block of
the block being filled (or None right after a block closed); how many transformer layers have
been applied; and, for two-phase depth attention, the phase-1 results of the segment being run
(``Phase1Cache``, never part of a payload). It is created by the embedding for one micro-batch
and dropped after the head: nothing survives between micro-batches, batches, or train and eval.

The store grows into a preallocated buffer (``StoreBuffer``: ``capacity`` rows, fixed by the
block plan for the layers that will run on it): closing a block writes one row, so a forward
pass copies each block once. Each store the model sees is a separate tensor aliasing the
buffer's leading rows (``_alias``), with its own version counter: writing row ``c`` does not
invalidate a smaller store that an autograd node saved (those rows never change), which a view
of the buffer would.

In backward the buffer also holds the rows' gradient, one ``[capacity, s, b, h]`` tensor: a
reader that can (the fused phase-1 kernel) adds its share there directly, and ``_Append`` adds
what reached its store through autograd (any other reader, a later stage) and hands the row it
appended its finished gradient, for every reader of a row ran after it in forward. Without
this, every store of a pass would get a gradient tensor of its own and autograd would add them
prefix by prefix: traffic quadratic in the number of blocks.

With Megatron's document options the state also carries the micro-batch's ``DocumentLayout``
(per-sample positions and attention mask, ``model/document_masks.py``); it is data, not a
source, and every layer hands it on unchanged.

Baseline mode uses the same container with no store and the running hidden state as the
partial, so every layer speaks one interface.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

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
    row: then no row is zero-filled (the 32 x 64 Full model's buffer is 33 MB).
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

    def grad_row(self, row: int) -> torch.Tensor:
        """Row ``row``'s gradient so far (zeros where nothing was added yet)."""
        self._set(row, row + 1)
        return self._grad[row]

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


class _Append(torch.autograd.Function):
    """``cat([store, (row + addend)[None]])`` written into ``buffer`` in place, returned as an
    alias, and the new row as one too (the closed block, for a phase 2 that merges it).
    ``addend`` (or None) is added on the way: closing a Block block writes ``partial + out``
    straight into its row, where the sum would be formed, then copied (one pass and one autograd
    node fewer per block)."""

    @staticmethod
    def forward(ctx, store, row, buffer: StoreBuffer, addend=None):
        c = store.shape[0]
        ctx.copied = not buffer.holds(store)
        if ctx.copied:
            buffer.data[:c].copy_(store)
        if addend is None:
            buffer.data[c].copy_(row)
        else:
            torch.add(row, addend, out=buffer.data[c])
        ctx.rows, ctx.buffer = c, buffer
        ctx.set_materialize_grads(False)
        return _alias(buffer.data, c + 1), _alias_row(buffer.data, c)

    @staticmethod
    def backward(ctx, grad, grad_row=None):
        c = ctx.rows
        if grad is not None:  # readers that returned their gradient through autograd
            ctx.buffer.add_grad(grad)
        if grad_row is not None:
            ctx.buffer.add_grad(grad_row.unsqueeze(0), c)
        # every reader of row c read a store this append made (or a later one), so they have
        # all run; rows < c of an aliased store may still get gradient from readers of the
        # store this one grew (they gather in the buffer until the append that wrote them),
        # so only row c is read here: filling the others would zero rows a later reader
        # writes in full. A copied store's readers of this store's rows ran already.
        if not ctx.copied:
            row = ctx.buffer.grad_row(c)
            return None, row, None, row if ctx.needs_input_grad[3] else None
        acc = ctx.buffer.grad(c + 1)
        return acc[:c], acc[c], None, acc[c] if ctx.needs_input_grad[3] else None


class _Adopt(torch.autograd.Function):
    """A received payload ``[k, s, b, h]`` as a state's parts: its completed blocks copied into
    ``buffer`` (returned as the buffer's alias, so the stage's readers gather their gradient
    there and later blocks grow in place) and its partial block, if any (a copy of the last
    row). Backward hands the payload ONE gradient (the buffer's rows, and the partial block's):
    slicing the payload would give each part a zero-filled gradient of the whole payload,
    added up."""

    @staticmethod
    def forward(ctx, payload, completed: int, has_partial: bool, buffer: StoreBuffer):
        buffer.data[:completed].copy_(payload[:completed])
        ctx.completed, ctx.has_partial, ctx.buffer = completed, has_partial, buffer
        ctx.set_materialize_grads(False)
        store = _alias(buffer.data, completed)
        if not has_partial:
            return store
        return store, payload[completed].clone()

    @staticmethod
    def backward(ctx, grad_store, grad_partial=None):
        c, buffer = ctx.completed, ctx.buffer
        if grad_store is not None:  # readers that returned their gradient through autograd
            buffer.add_grad(grad_store)
        rows = buffer.grad(c)[:c]  # every reader of these rows read this store or a later one
        if not ctx.has_partial:
            return rows, None, None, None
        grad = rows.new_empty((c + 1, *rows.shape[1:]))
        grad[:c].copy_(rows)
        grad[c].copy_(grad_partial) if grad_partial is not None else grad[c].zero_()
        return grad, None, None, None


@dataclass(frozen=True)
class Phase1Cache:
    """Phase-1 results of one segment: sublayers ``first ..`` over the first ``rows`` blocks."""

    first: int  # the segment's first sublayer (1-based)
    rows: int  # completed blocks phase 1 attended over
    out1: tuple[torch.Tensor, ...]  # S' x [s, b, h] float32
    lse: tuple[torch.Tensor, ...]  # S' x [s, b] float32
    # blocks closed since the segment began (Full: the group's own outputs), as the tensors
    # that were appended: phase 2 reads them without slicing the store, whose slice would
    # backpropagate a zero-filled gradient of the whole store per sublayer
    closed: tuple[torch.Tensor, ...] = ()
    # out1[0] is the first sublayer's normalised input (phase 1 applied its RMSNorm)
    first_normed: bool = False

    def handed_on(self, sublayer: int) -> Phase1Cache:
        """The results that sublayers ``sublayer ..`` still read, for the next layer: earlier
        sublayers' entries dropped (None). Inside a compiled region the rest are made
        contiguous too: a region's outputs are its graph's, and a graph that outputs a
        strided slice of phase 1's ``[T, S, D]`` product gets back a contiguous gradient
        that its backward copies into that layout first; an output nothing reads back
        gets a gradient of zeros made for it."""
        k = sublayer - self.first
        compiling = torch.compiler.is_compiling()

        def keep(results):
            return tuple(
                None if i < k else t.contiguous() if compiling else t for i, t in enumerate(results)
            )

        return replace(self, out1=keep(self.out1), lse=keep(self.lse))


@dataclass(frozen=True)
class DepthState:
    store: torch.Tensor | None  # [c, s, b, h] completed blocks; None in baseline mode
    partial: torch.Tensor | None
    layers_done: int = 0
    layout: Any = None  # DocumentLayout or None (plain causal attention, positions 0 .. s-1)
    buffer: StoreBuffer | None = None  # storage the store grows into, and its gradient
    phase1: Phase1Cache | None = None

    @staticmethod
    def start(v0: torch.Tensor, layout=None) -> DepthState:
        """The state right after the embedding: ``b_0 = v_0``, no partial block."""
        return DepthState(v0.unsqueeze(0), None, 0, layout)

    @property
    def num_completed(self) -> int:
        return 0 if self.store is None else self.store.shape[0]

    @property
    def completed(self) -> tuple[torch.Tensor, ...]:
        return () if self.store is None else tuple(self.store.unbind(0))

    def sources(self) -> list[torch.Tensor]:
        """What the next depth attention reads: completed blocks, then the partial block."""
        out = list(self.completed)
        if self.partial is not None:
            out.append(self.partial)
        return out

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The state as few tensors: the store, then the partial block if any."""
        out = () if self.store is None else (self.store,)
        return out if self.partial is None else (*out, self.partial)

    def append(
        self, row: torch.Tensor, capacity: int, addend: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, StoreBuffer | None]:
        """(store with ``row`` (+ ``addend``) appended, that row as the store holds it, the
        buffer holding them); grows into ``self.buffer``."""
        c = self.num_completed
        buffer = self.buffer
        if self.store is None:
            row = row if addend is None else row + addend
            return row.unsqueeze(0), row, None
        dtype = self.store.dtype
        if addend is not None and (row.dtype != dtype or addend.dtype != dtype):
            row, addend = row + addend, None  # the sum in the sources' precision, then cast
        if torch.compiler.is_compiling():
            # inside a compiled region the store is a value: a functional append, which the
            # compiler sees (the buffer's aliases and gradient rows are eager-only)
            row = (row if addend is None else row + addend).to(dtype)
            return torch.cat([self.store, row.unsqueeze(0)]), row, None
        if buffer is None or buffer.capacity <= c or not buffer.holds(self.store):
            buffer = StoreBuffer(
                torch.empty(
                    (max(capacity, c + 1), *self.store.shape[1:]),
                    dtype=dtype,
                    device=self.store.device,
                )
            )
        store, row = _Append.apply(self.store, row.to(dtype), buffer, addend)
        return store, row, buffer

    def close_block(self, capacity: int, out: torch.Tensor | None = None) -> DepthState:
        """The partial block (``+ out``, a sublayer's output not yet added to it) appended to
        the store; no partial block after it."""
        if out is not None and self.partial is None:
            partial, out = out, None
        else:
            partial = self.partial
        store, row, buffer = self.append(partial, capacity, addend=out)
        phase1 = self.phase1
        if phase1 is not None:
            phase1 = replace(phase1, closed=(*phase1.closed, row))
        return replace(self, store=store, partial=None, buffer=buffer, phase1=phase1)

    def add(self, out: torch.Tensor, closes: bool, capacity: int) -> DepthState:
        """The state after a sublayer's output ``out``: added to the partial block (baseline:
        to the residual stream), which ``closes`` appends to the store (the sum written
        straight into its row; ``capacity``: rows of the store's buffer)."""
        if closes:
            return self.close_block(capacity, out)
        return replace(self, partial=out if self.partial is None else self.partial + out)

    def payload(self) -> torch.Tensor:
        """ONE tensor ``[k, s, b, h]``: the store, plus the partial block as its last row."""
        if self.store is None:
            return self.partial.unsqueeze(0)
        if self.partial is None:
            return self.store
        return self.append(self.partial, self.num_completed + 1)[0]

    def to(self, dtype: torch.dtype) -> DepthState:
        """The state with every tensor in ``dtype`` (the phase-1 cache stays float32)."""
        store, buffer = self.store, self.buffer
        if store is not None and store.dtype != dtype:
            store, buffer = store.to(dtype), None
        partial = None if self.partial is None else self.partial.to(dtype)
        return replace(self, store=store, partial=partial, buffer=buffer)

    @staticmethod
    def from_parts(
        parts, num_completed: int, has_partial: bool, layers_done: int, buffer=None, layout=None
    ) -> DepthState:
        """Inverse of :meth:`parts` (``buffer``: where the store may keep growing)."""
        parts = tuple(parts)
        store = parts[0] if num_completed else None
        partial = parts[-1] if has_partial else None
        if len(parts) != int(num_completed > 0) + int(has_partial):
            raise ValueError(f"depth state parts: got {len(parts)} tensors")
        return DepthState(store, partial, layers_done, layout, buffer)

    @staticmethod
    def from_payload(
        payload: torch.Tensor, num_completed: int, has_partial: bool, layers_done: int
    ) -> DepthState:
        """Inverse of :meth:`payload`: views of the received tensor, no copy."""
        if num_completed == 0:
            return DepthState(None, payload[0] if has_partial else None, layers_done)
        partial = payload[num_completed] if has_partial else None
        return DepthState(payload[:num_completed], partial, layers_done)

    @staticmethod
    def adopt_payload(
        payload: torch.Tensor,
        num_completed: int,
        has_partial: bool,
        layers_done: int,
        capacity: int,
    ) -> DepthState:
        """Inverse of :meth:`payload` into a new store buffer of ``capacity`` rows (the blocks
        copied once; see ``_Adopt``), for a stage whose layers grow the store further."""
        if num_completed == 0:
            return DepthState.from_payload(payload, 0, has_partial, layers_done)
        buffer = StoreBuffer(payload.new_empty((max(capacity, num_completed), *payload.shape[1:])))
        parts = _Adopt.apply(payload, num_completed, has_partial, buffer)
        store, partial = parts if has_partial else (parts, None)
        return DepthState(store, partial, layers_done, buffer=buffer)

    @staticmethod
    def from_tensors(
        tensors, num_completed: int, has_partial: bool, layers_done: int, layout=None
    ) -> DepthState:
        """A state from its sources one by one (the store is stacked: one copy)."""
        tensors = tuple(tensors)
        if len(tensors) != num_completed + int(has_partial):
            raise ValueError(
                f"depth state after {layers_done} layers needs {num_completed} completed blocks"
                f"{' + a partial block' if has_partial else ''}, got {len(tensors)} tensors"
            )
        partial = tensors[-1] if has_partial else None
        completed = tensors[:-1] if has_partial else tensors
        store = torch.stack(completed) if completed else None
        return DepthState(store, partial, layers_done, layout)
