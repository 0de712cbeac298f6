"""The depth-attention state that flows from layer to layer within one forward pass.

``DepthState`` holds the completed block representations (``b_0`` = embedding first) as ONE
tensor, the *store* ``[c, s, b, h]``, so that attention over the completed blocks is one
batched read and a stage boundary sends the store plus the partial block; the partial block of
the block being filled (or None right after a block closed); how many transformer layers have
been applied; and, for two-phase depth attention, the phase-1 results of the segment being run
(``Phase1Cache``, never part of a payload). It is created by the embedding for one micro-batch
and dropped after the head: nothing survives between micro-batches, batches, or train and eval.

The store grows into a preallocated buffer where each closed block is written once, and which
gathers the rows' gradient in backward (``model/store_buffer.py``).

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

from attnres_dist.model.store_buffer import StoreBuffer, write_rows


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
    # Delta AttnRes: the sum of the ``rows`` blocks, the residual stream's share of them
    stream: torch.Tensor | None = None

    def handed_on(self, sublayer: int) -> Phase1Cache:
        """The results that sublayers ``sublayer ..`` still read, for the next layer: earlier
        sublayers' entries dropped (None)."""
        k = sublayer - self.first

        def keep(results):
            return tuple(None if i < k else t for i, t in enumerate(results))

        return replace(self, out1=keep(self.out1), lse=keep(self.lse))


@dataclass(frozen=True)
class DepthState:
    store: torch.Tensor | None  # [c, s, b, h] completed blocks; None in baseline mode
    partial: torch.Tensor | None
    layers_done: int = 0
    layout: Any = None  # DocumentLayout or None (plain causal attention, positions 0 .. s-1)
    buffer: StoreBuffer | None = None  # storage the store grows into, and its gradient
    phase1: Phase1Cache | None = None
    # inside a compiled region (``in_region``): the store is a value there, each append a
    # ``torch.cat`` that the compiler sees (a buffer's aliases and gradient rows are eager's)
    functional: bool = False

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

    def stream(self) -> torch.Tensor:
        """The residual stream that Delta AttnRes adds its mix to (and its final norm reads):
        every completed block and the partial block, summed."""
        out = self.store.sum(0)
        return out if self.partial is None else out + self.partial

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
        if self.functional:
            row = (row if addend is None else row + addend).to(dtype)
            return torch.cat([self.store, row.unsqueeze(0)]), row, None
        held = buffer is not None and buffer.capacity > c and buffer.holds(self.store)
        if not held:
            buffer = StoreBuffer(
                torch.empty(
                    (max(capacity, c + 1), *self.store.shape[1:]),
                    dtype=dtype,
                    device=self.store.device,
                )
            )
        row = row.to(dtype).unsqueeze(0)
        if held:
            store, row = write_rows(buffer, self.store, [row], addend)
        else:
            store, row = write_rows(buffer, None, [self.store, row], addend)
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

    def merge_inputs(self, sublayer: int, grad_into: bool = False, with_partial: bool = True):
        """(out1, lse, extra, into) of ``sublayer`` from the phase-1 results: extra may be
        None, and after the empty phase 1 it is the tuple of pieces that hold every source, in
        order; ``into`` (None unless ``grad_into``, the op's capability) gives the gradient
        rows of an extra that is a range of store rows, for the op to add that extra's
        gradient to. ``with_partial``: the partial block is an extra (Delta mixes completed
        blocks only)."""
        cache = self.phase1
        k = sublayer - cache.first
        later = self.num_completed - cache.rows  # Full: the group's outputs, in the store
        if later and self.partial is None and grad_into and self.holds_store():
            # read in place: their gradient goes to the buffer, so no slice backpropagates a
            # zero-filled gradient of the whole store
            rows, buffer = slice(cache.rows, self.num_completed), self.buffer
            into = lambda: buffer.grad_rows(rows.start, rows.stop)  # noqa: E731
            return cache.out1[k], cache.lse[k], self.store[rows], into
        extra = []
        closed = cache.closed
        received = later - len(closed)
        if received:  # Full: the group's earlier outputs that came with the state (a cut)
            extra.append(self.store[cache.rows : cache.rows + received])
        if closed:  # Full: the group's outputs closed since the segment began
            extra.append(torch.stack(closed))
        if self.partial is not None and with_partial:  # Block: the partial block
            extra.append(self.partial.unsqueeze(0))
        if cache.rows == 0 and extra:
            # the empty phase 1 (a one-pass backend): its kernel reads every source where it
            # lies, so the pieces go as they are (the whole store itself, not a slice of it)
            if received == self.num_completed:
                extra[0] = self.store
            return cache.out1[k], cache.lse[k], tuple(extra), None
        extra = None if not extra else extra[0] if len(extra) == 1 else torch.cat(extra)
        return cache.out1[k], cache.lse[k], extra, None

    def store_grad_into(self, rows: int) -> dict:
        """Phase 1's ``grad_into`` option over the store's first ``rows`` rows: their gradient
        added in the store's buffer, where the store is one (else no option)."""
        if not self.holds_store():
            return {}
        buffer = self.buffer
        return {"grad_into": lambda: buffer.grad_rows(0, rows)}

    def holds_store(self) -> bool:
        """Whether the store is its buffer's leading rows (an alias, not a copy)."""
        return self.buffer is not None and self.buffer.holds(self.store)

    def in_region(self) -> DepthState:
        """The state as a compiled region takes it: the store a value (``functional``)."""
        return replace(self, buffer=None, functional=True)

    def out_of_region(self) -> DepthState:
        """The state as a compiled region hands it back: the store a tensor to grow from,
        the phase-1 results that later sublayers read contiguous. A region's outputs are
        its graph's, and a graph that outputs a strided slice of phase 1's ``[T, S, D]``
        product gets back a contiguous gradient that its backward copies into that layout
        first; an output nothing reads back gets a gradient of zeros made for it
        (``handed_on`` drops those)."""
        return replace(self.with_contiguous_phase1(), functional=False)

    def with_contiguous_phase1(self) -> DepthState:
        """The state with its phase-1 results contiguous: as a compiled region hands them
        on, and as a segment inside a region makes them (there, a checkpointed merge reading a
        phase-1 result as an unbound piece of phase 1's product is a graph AOTAutograd cannot
        partition: the ``unbind`` must be saved and cannot be)."""
        phase1 = self.phase1
        if phase1 is None:
            return self

        def contiguous(results):
            return tuple(None if t is None else t.contiguous() for t in results)

        return replace(
            self, phase1=replace(phase1, out1=contiguous(phase1.out1), lse=contiguous(phase1.lse))
        )

    def payload(self) -> torch.Tensor:
        """ONE tensor ``[k, s, b, h]``: the store, plus the partial block as its last row."""
        if self.store is None:
            return self.partial.unsqueeze(0)
        if self.partial is None:
            return self.store
        return self.append(self.partial, self.num_completed + 1)[0]

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
        copied once; see ``_WriteRows``), for a stage whose layers grow the store further."""
        if num_completed == 0:
            return DepthState.from_payload(payload, 0, has_partial, layers_done)
        partial = payload[num_completed] if has_partial else None
        return DepthState.assemble([payload[:num_completed]], partial, layers_done, capacity)

    @staticmethod
    def assemble(
        pieces: list[torch.Tensor],
        partial: torch.Tensor | None,
        layers_done: int,
        capacity: int,
    ) -> DepthState:
        """A state whose store is ``pieces`` (each ``[k, s, b, h]``: cached and received
        blocks) written in order into a new buffer of ``capacity`` rows, where the layers
        after it grow the store in place."""
        like = pieces[0]
        rows = sum(p.shape[0] for p in pieces)
        buffer = StoreBuffer(like.new_empty((max(capacity, rows), *like.shape[1:])))
        store, _ = write_rows(buffer, None, pieces)
        return DepthState(store, partial, layers_done, buffer=buffer)
