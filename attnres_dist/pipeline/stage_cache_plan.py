"""Cross-stage caching of block representations over a virtual layout: the static plan.

With V chunks per rank a micro-batch visits each rank V times (``virtual_layout``). Every later
sublayer attends over all completed blocks, so a naive contract resends all of them at every
transition chunk c -> c + 1. A rank already holds the blocks it received or produced in its
earlier chunks for the same micro-batch; with caching a transition carries only the completed
blocks the receiver lacks, plus the partial block if one is open at the cut. Everything here
follows from the ``BlockPlan`` and the layout, so every payload shape is static:

* ``Transition``: per hand-over, the block indices (0 = the embedding ``b_0``) sent naively
  and cached, whether a partial block crosses, and the shapes ``[k, s, b, h]``. The V's turn
  (DualPipeV, rank P - 1 hands chunk P - 1 to its own chunk P) stays on the rank: no bytes.
* ``CacheEntry``: per (rank, block) a rank keeps for its later chunks: the chunk whose graph
  owns the tensor on that rank (where it arrived or closed), the later chunks that read it as a
  detached leaf, and therefore where their stashed gradients are injected (that source chunk's
  backward) and when the entry is freed (after that backward; all of a micro-batch's entries on
  a rank are gone once its first chunk there has run backward).

``keep_produced=False`` keeps only received blocks, the accounting of the paper's formula
``P(P-1)/2 N_p + (V-1) P^2 N_p``; the default (keep what was received or produced) sends
``P(P-1)/2 N_p + (V-1) P (P-1) N_p`` on the looped layout when blocks align with chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from attnres_dist.config.block_plan import BlockPlan
from attnres_dist.pipeline.virtual_layout import VirtualLayout


@dataclass(frozen=True)
class Transition:
    src_chunk: int
    src_rank: int
    dst_rank: int
    layers_before: int
    kind: str  # "blocks", "hidden" (the next chunk starts with the head) or "local" (V's turn)
    completed: int  # completed blocks at the cut, b_0 included
    partial: bool
    cached_blocks: tuple[int, ...]  # completed blocks the receiver lacks
    tensor_shape: tuple[int, int, int]  # [s, b, h]
    itemsize: int

    @property
    def dst_chunk(self) -> int:
        return self.src_chunk + 1

    @property
    def naive_blocks(self) -> tuple[int, ...]:
        return tuple(range(self.completed))

    @property
    def naive_k(self) -> int:
        return 1 if self.kind == "hidden" else self.completed + int(self.partial)

    @property
    def cached_k(self) -> int:
        return 1 if self.kind == "hidden" else len(self.cached_blocks) + int(self.partial)

    def shape(self, cached: bool) -> tuple[int, ...]:
        if self.kind == "hidden":
            return self.tensor_shape
        return (self.cached_k if cached else self.naive_k, *self.tensor_shape)

    def nbytes(self, cached: bool) -> int:
        """Bytes per micro-batch one way (the gradient sent back has the same shape)."""
        if self.kind == "local":
            return 0
        n = self.itemsize
        for dim in self.shape(cached):
            n *= dim
        return n

    @property
    def name(self) -> str:
        ranks = f"rank {self.src_rank} -> {self.dst_rank}"
        return f"chunk {self.src_chunk} -> {self.dst_chunk} ({ranks})"


@dataclass(frozen=True)
class CacheEntry:
    rank: int
    block: int
    source_chunk: int  # whose backward receives the stashed gradients and after which it is freed
    received: bool  # arrived in source_chunk's input (else: closed inside source_chunk)
    consumers: tuple[int, ...]  # later chunks on the rank that read it from the cache


@dataclass(frozen=True)
class CachePlan:
    layout: VirtualLayout
    block_plan: BlockPlan
    seq_length: int
    micro_batch_size: int
    hidden_size: int
    itemsize: int = 4
    keep_produced: bool = True

    def __post_init__(self):
        if self.block_plan.num_layers != self.layout.num_layers:
            raise ValueError("the block plan and the layout disagree on the number of layers")

    def _completed(self, layers: int) -> int:
        return self.block_plan.state_after(2 * layers)[0]

    def _held_after(self, chunk: int) -> int:
        """Blocks 0 .. n - 1 the rank of ``chunk`` holds after running it (for later chunks)."""
        lay = self.layout
        if lay.starts_with_head(chunk):
            return 0
        if self.keep_produced:
            return self._completed(lay.layers_before(chunk) + len(lay.layers_of(chunk)))
        return self._completed(lay.layers_before(chunk))

    def _earlier(self, chunk: int) -> list[int]:
        lay = self.layout
        return [c for c in lay.chunks_of(lay.rank_of(chunk)) if c < chunk]

    @cached_property
    def transitions(self) -> tuple[Transition, ...]:
        lay, out = self.layout, []
        for c in range(lay.C - 1):
            d = c + 1
            layers = lay.layers_before(d)
            completed, partial = self.block_plan.state_after(2 * layers)
            if lay.is_local(c):
                kind, lacking = "local", ()
            elif lay.starts_with_head(d):
                kind, lacking, completed, partial = "hidden", (), 0, False
            else:
                kind = "blocks"
                held = max((self._held_after(e) for e in self._earlier(d)), default=0)
                lacking = tuple(range(min(held, completed), completed))
            out.append(
                Transition(
                    c,
                    lay.rank_of(c),
                    lay.rank_of(d),
                    layers,
                    kind,
                    completed,
                    partial,
                    lacking,
                    (self.seq_length, self.micro_batch_size, self.hidden_size),
                    self.itemsize,
                )
            )
        return tuple(out)

    @cached_property
    def entries(self) -> tuple[CacheEntry, ...]:
        """What each rank keeps per micro-batch in flight (the same for every micro-batch)."""
        lay, out = self.layout, []
        for rank in range(lay.P):
            chunks = lay.chunks_of(rank)
            seen: set[int] = set()
            for i, chunk in enumerate(chunks):
                later = tuple(c for c in chunks[i + 1 :] if not lay.starts_with_head(c))
                if chunk > 0 and not lay.starts_with_head(chunk):
                    arrived = range(self._completed(lay.layers_before(chunk)))
                else:
                    arrived = range(0)
                kept = range(self._held_after(chunk))
                for block in kept:
                    if block in seen:
                        continue
                    seen.add(block)
                    if later:
                        out.append(CacheEntry(rank, block, chunk, block in arrived, later))
        return tuple(out)

    def entries_of(self, rank: int) -> list[CacheEntry]:
        return [e for e in self.entries if e.rank == rank]

    def phase_shapes(self, rank: int, cached: bool = True) -> list[dict[str, tuple | None]]:
        """Per phase of ``rank``: the shape it receives (activation in, gradient out) and sends.

        One transition enters and one leaves each chunk, so a phase's shapes are fixed: what an
        engine allocates for its receives instead of exchanging shapes. None: no p2p there.
        """
        out = []
        for chunk in self.layout.chunks_of(rank):
            into = self.transitions[chunk - 1] if chunk > 0 else None
            out_of = self.transitions[chunk] if chunk < self.layout.C - 1 else None
            out.append(
                {
                    "recv": into.shape(cached) if into and into.kind != "local" else None,
                    "send": out_of.shape(cached) if out_of and out_of.kind != "local" else None,
                }
            )
        return out

    def bytes_per_micro_batch(self, cached: bool) -> int:
        """Activation bytes of one micro-batch's forward over all transitions."""
        return sum(t.nbytes(cached) for t in self.transitions)

    def peak_width(self, cached: bool) -> int:
        return max((t.shape(cached)[0] for t in self.transitions if t.kind == "blocks"), default=0)

    def block_bytes(self) -> int:
        return self.seq_length * self.micro_batch_size * self.hidden_size * self.itemsize

    def peak_cache(self, orders) -> list[int]:
        """Most cache entries alive at once per rank, for per-rank pass orders.

        ``orders[r]`` lists rank r's passes as (forward, chunk, micro_batch) in execution order
        (``schedule_sim.SimResult.orders``); an entry lives from its source chunk's forward to
        that chunk's backward for its micro-batch.
        """
        peaks = []
        for rank, order in enumerate(orders):
            per_chunk: dict[int, int] = {}
            for e in self.entries_of(rank):
                per_chunk[e.source_chunk] = per_chunk.get(e.source_chunk, 0) + 1
            alive = peak = 0
            for forward, chunk, _ in order:
                alive += per_chunk.get(chunk, 0) * (1 if forward else -1)
                peak = max(peak, alive)
            peaks.append(peak)
        return peaks


def looped_cached_formula(P: int, V: int, n_p: int, keep_produced: bool = True) -> int:
    """Completed blocks (b_0 aside) sent per micro-batch on the looped layout, aligned blocks.

    The first round's hand-overs carry 1 .. P - 1 chunks' blocks; each later one carries what
    the receiver has not seen since its previous chunk: P - 1 chunks (P, the paper's count, if
    it keeps only what it received).
    """
    later = P if not keep_produced else P - 1
    return P * (P - 1) // 2 * n_p + (V - 1) * P * later * n_p


def vshape_cached_formula(P: int, n_p: int) -> int:
    """Same for DualPipeV's V: the way out like a first round, then rank q lacks 2 (P-1-q)."""
    return P * (P - 1) // 2 * n_p + P * (P - 1) * n_p


def naive_formula(C: int, n_p: int, local_turn_chunks: int | None = None) -> int:
    """Completed blocks (b_0 aside) sent naively: C (C - 1) / 2 N_p, less a turn kept local."""
    total = C * (C - 1) // 2 * n_p
    return total - (local_turn_chunks * n_p if local_turn_chunks else 0)
