"""The cross-stage cache at run time: the chunk boundary that sends only what a rank lacks.

``CachedBoundary`` is one rank's implementation of the chunk-boundary interface
(``receive`` / ``send`` / ``backward_extras`` / ``after_backward`` / ``check_empty``), driven by
the static ``CachePlan`` (``stage_cache_plan.py``). Per micro-batch in flight it keeps the
block tensors that its later chunks read (plan entries): a block that arrived in a chunk's
input as a row of the received payload (a view of that leaf), a block closed inside a chunk as
the row of that chunk's final store (a node of its graph).

* ``receive(d, mb, payload)``: the payload holds only the blocks the receiver lacks plus the
  partial block. The cached blocks enter as DETACHED leaves (``requires_grad``), so every
  chunk's autograd graph stays its own and no backward runs through another chunk's graph
  twice (no ``retain_graph``). They and the received rows are written once into one buffer
  that has room for the blocks the chunk will close, so the store grows in place afterwards:
  the completed blocks are copied once per chunk, as the naive contract's first append does.
* ``send(d, mb, state)``: exactly the plan's payload, ``[k, s, b, h]``.
* ``after_backward(d, mb)``: the ``.grad`` of the leaves chunk d read is added to the stash of
  each block's entry (several later chunks may read one block).
* ``backward_extras(c, mb)``: for the entries chunk c owns, (kept tensor, stashed gradient)
  pairs that its backward propagates with its outputs, so each cached block's gradient reaches
  its producer once; ``after_backward(c, mb)`` then frees those entries. A source chunk's
  backward comes after all its consumers' (they are downstream of it), so stashes are complete.
* Forward-only passes (no grad) keep no leaves and no stash; an entry is dropped when its last
  consumer on the rank has received, so eval leaves nothing behind.

Memory. A live entry is one ``[s, b, h]`` block. In training a kept tensor is a view of a
payload or store buffer that the source chunk's graph holds until its backward anyway; the
stash is new memory, one ``[s, b, h]`` per entry whose consumers have run backward. The plan
predicts the most entries alive per rank for a schedule (``CachePlan.peak_cache``); the
boundary measures it (``peak_entries``; ``peak_bytes`` = kept + stashed, ``peak_stash_bytes``;
``stats()``). Keeping produced blocks (the plan's default) sends fewer bytes and keeps more
entries: tiny model (4 layers, block size 2, s = 128, b = 8, h = 128, 512 KiB a block), P = 2,
interleaved V = 2, M = 4: 2.0 MiB per micro-batch against 4.5 MiB naive, peak 8 and 9 entries on
ranks 0 and 1 (4 and 6 keeping only received blocks, which sends 3.0 MiB).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from attnres_dist.model.depth_state import DepthState
from attnres_dist.pipeline.contract import check_payload, pack
from attnres_dist.pipeline.stage_cache_plan import CachePlan


class CacheLeakError(RuntimeError):
    """Cached blocks or stashed gradients left over where none may be (optimizer step, eval)."""


class CachedBoundary:
    """One rank's chunk boundary with cross-stage caching (see the module docstring)."""

    cached = True  # sends CachePlan's cached payload shapes (``phase_shapes(rank, cached=True)``)

    def __init__(self, plan: CachePlan, rank: int):
        self.plan, self.rank = plan, rank
        lay = plan.layout
        self.layout, self.block_plan = lay, plan.block_plan
        self.entries = {e.block: e for e in plan.entries_of(rank)}
        self._by_source = defaultdict(list)
        for e in self.entries.values():
            self._by_source[e.source_chunk].append(e)
        self._reads = {d: self._cached_reads(rank, d) for d in lay.chunks_of(rank)}
        self._lo = {}  # per chunk sent: completed blocks the receiver takes from its cache
        for t in plan.transitions:
            if t.src_rank != rank or t.kind == "hidden":
                continue
            lo = len(self._cached_reads(t.dst_rank, t.dst_chunk))
            if t.kind == "blocks" and t.cached_blocks != tuple(range(lo, t.completed)):
                raise AssertionError(f"{t.name}: plan payload {t.cached_blocks}, cache has {lo}")
            self._lo[t.src_chunk] = lo
        self._kept: dict[tuple[int, int], torch.Tensor] = {}  # (micro-batch, block)
        self._stash: dict[tuple[int, int], torch.Tensor] = {}
        self._pending: dict[tuple[int, int], set[int]] = {}  # consumers yet to run backward
        self._leaves: dict[tuple[int, int], dict[int, torch.Tensor]] = {}  # (chunk, mb)
        self._handed: set[tuple[int, int]] = set()
        self.peak_entries = 0
        self.peak_bytes = 0  # kept + stashed
        self.peak_stash_bytes = 0  # the part that is new memory in training

    def _cached_reads(self, rank: int, chunk: int) -> tuple[int, ...]:
        """Blocks ``chunk`` reads from its rank's cache: 0 .. n - 1 (entries are prefixes)."""
        blocks = tuple(sorted(e.block for e in self.plan.entries_of(rank) if chunk in e.consumers))
        if blocks != tuple(range(len(blocks))):
            raise AssertionError(f"chunk {chunk} reads cached blocks {blocks}: not a prefix")
        return blocks

    def _boundary(self, chunk: int) -> str:
        n = self.layout.layers_before(chunk)
        return f"boundary into chunk {chunk} on rank {self.rank} (after {n} layers)"

    # -- forward --------------------------------------------------------------------------

    def receive(self, chunk: int, micro_batch: int, payload: torch.Tensor) -> DepthState:
        lay = self.layout
        layers = lay.layers_before(chunk)
        completed, has_partial = self.block_plan.state_after(2 * layers)
        reads = self._reads[chunk]
        fresh = completed - len(reads)
        expected = fresh + int(has_partial)
        check_payload(
            payload,
            expected,
            lambda got: (
                f"{self._boundary(chunk)}: received payload {got}, but the cache plan "
                f"({self.block_plan.describe()}) sends {expected} tensors [k={expected}, s, b, h]"
                f" there ({completed} completed blocks, {len(reads)} of them cached)"
            ),
        )
        grad = torch.is_grad_enabled()
        cached = []
        for block in reads:
            kept = self._kept.get((micro_batch, block))
            if kept is None:
                src = self.entries[block].source_chunk
                raise RuntimeError(
                    f"{self._boundary(chunk)}: cached block {block} of micro-batch "
                    f"{micro_batch} is not held (chunk {src} has not run it forward)"
                )
            cached.append(kept.detach().requires_grad_(grad and kept.requires_grad))
        if grad and cached:
            self._leaves[(chunk, micro_batch)] = dict(zip(reads, cached, strict=True))
        partial = payload[fresh] if has_partial else None
        if not cached:  # everything arrived: views of the payload, as the naive contract
            state = DepthState.from_payload(payload, completed, has_partial, layers)
        else:
            end = layers + len(lay.layers_of(chunk))
            pieces = [block.unsqueeze(0) for block in cached] + [payload[:fresh]]
            capacity = self.block_plan.boundary_width(end)
            state = DepthState.assemble(pieces, partial, layers, capacity)
        for e in self._by_source[chunk]:
            if e.received:
                self._keep(micro_batch, e, payload[e.block - len(reads)])
        if not grad:  # forward only: an entry is done once its last consumer has read it
            for block in reads:
                if max(self.entries[block].consumers) == chunk:
                    self._drop(micro_batch, block)
        return state

    def send(self, chunk: int, micro_batch: int, state: DepthState) -> torch.Tensor:
        if not isinstance(state, DepthState):
            raise TypeError(f"chunk {chunk} sends a {type(state).__name__}, not a DepthState")
        expected = self.layout.layers_before(chunk + 1)
        if state.layers_done != expected:
            raise RuntimeError(
                f"chunk {chunk} ends after {state.layers_done} layers, the layout says {expected}"
            )
        for e in self._by_source[chunk]:
            if not e.received:
                self._keep(micro_batch, e, state.store[e.block])
        lo = self._lo[chunk]
        if lo == 0:
            return pack(state)
        if state.partial is None:
            return state.store[lo:]
        if state.buffer is None:  # the store is not in a growable buffer: copy only the rows sent
            return torch.cat([state.store[lo:], state.partial.unsqueeze(0)])
        return pack(state)[lo:]  # the partial written after the store in its buffer

    def _keep(self, micro_batch: int, entry, tensor: torch.Tensor) -> None:
        key = (micro_batch, entry.block)
        if key in self._kept:
            raise CacheLeakError(
                f"rank {self.rank}: block {entry.block} of micro-batch {micro_batch} is still "
                f"cached from an earlier pass (chunk {entry.source_chunk} ran forward twice "
                "without a backward)"
            )
        self._kept[key] = tensor
        if torch.is_grad_enabled():
            self._pending[key] = set(entry.consumers)
        self._measure()

    def _drop(self, micro_batch: int, block: int) -> None:
        key = (micro_batch, block)
        self._kept.pop(key, None)
        self._stash.pop(key, None)
        self._pending.pop(key, None)

    def _measure(self) -> None:
        self.peak_entries = max(self.peak_entries, len(self._kept))
        kept = sum(t.numel() * t.element_size() for t in self._kept.values())
        stash = sum(t.numel() * t.element_size() for t in self._stash.values())
        self.peak_bytes = max(self.peak_bytes, kept + stash)
        self.peak_stash_bytes = max(self.peak_stash_bytes, stash)

    # -- backward -------------------------------------------------------------------------

    def backward_extras(self, chunk: int, micro_batch: int):
        tensors, grads = [], []
        for e in self._by_source[chunk]:
            key = (micro_batch, e.block)
            waiting = self._pending.get(key)
            if waiting:
                raise RuntimeError(
                    f"rank {self.rank}: backward of chunk {chunk} for micro-batch {micro_batch} "
                    f"before chunks {sorted(waiting)}' (cached block {e.block}'s gradient is "
                    "incomplete)"
                )
            stash = self._stash.get(key)
            if stash is not None:
                tensors.append(self._kept[key])
                grads.append(stash)
        self._handed.add((chunk, micro_batch))
        return tensors, grads

    def after_backward(self, chunk: int, micro_batch: int) -> None:
        for block, leaf in self._leaves.pop((chunk, micro_batch), {}).items():
            key = (micro_batch, block)
            self._pending.get(key, set()).discard(chunk)
            if leaf.grad is not None:
                old = self._stash.get(key)
                # a tensor of its own: the leaf's gradient is a row of its store buffer's
                self._stash[key] = leaf.grad.clone() if old is None else old + leaf.grad
        self._measure()
        handed = (chunk, micro_batch) in self._handed
        self._handed.discard((chunk, micro_batch))
        for e in self._by_source[chunk]:
            if (micro_batch, e.block) in self._stash and not handed:
                raise CacheLeakError(
                    f"rank {self.rank}: chunk {chunk}'s backward for micro-batch {micro_batch} "
                    f"ran without the stashed gradient of cached block {e.block} "
                    "(backward_extras was not propagated)"
                )
            self._drop(micro_batch, e.block)

    def check_empty(self) -> None:
        left = sorted(set(self._kept) | set(self._stash))
        if left or self._leaves:
            what = ", ".join(
                f"micro-batch {mb} block {b} (owner chunk {self.entries[b].source_chunk})"
                for mb, b in left
            )
            if self._leaves:
                what += f"; leaves of (chunk, micro-batch) {sorted(self._leaves)}"
            raise CacheLeakError(f"cross-stage cache on rank {self.rank} is not empty: {what}")
        self._pending.clear()
        self._handed.clear()

    # -- measurement ----------------------------------------------------------------------

    @property
    def live_entries(self) -> int:
        return len(self._kept)

    def stats(self) -> dict:
        """Measured cache use of this rank (for the profiler and the benchmark)."""
        return {
            "rank": self.rank,
            "entries_per_micro_batch": len(self.entries),
            "live_entries": len(self._kept),
            "peak_entries": self.peak_entries,
            "peak_bytes": self.peak_bytes,
            "peak_stash_bytes": self.peak_stash_bytes,
            "block_bytes": self.plan.block_bytes(),
        }

    def reset_peaks(self) -> None:
        self.peak_entries = len(self._kept)
        self.peak_bytes = self.peak_stash_bytes = 0
        self._measure()
