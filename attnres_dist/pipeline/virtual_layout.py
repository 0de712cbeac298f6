"""Virtual pipeline layouts: which rank holds which model chunk, as pure functions.

With P pipeline ranks and V virtual stages per rank the model is cut into C = P * V chunks with
the partition rules of ``partition.py`` applied over C parts instead of P (``uniform``,
``parameters`` or explicit transformer-layer counts, one per chunk). Chunk 0 owns the embedding,
chunk C - 1 the final aggregation and the head (and the loss). Two placements:

* ``looped`` (Megatron's interleaved layout): chunk c on rank c mod P; activations go round the
  ranks V times, and rank P - 1 hands chunk c to rank 0's chunk c + 1.
* ``vshape`` (DualPipeV, V = 2): rank r holds chunks r and 2P - 1 - r; activations go out to
  rank P - 1, turn round on it without communication, and come back, so rank 0 holds both the
  embedding and the head, which is where DeepSpeed's ``DualPipeVEngine`` puts the loss.

A layout's *phase* on a rank is the rank-local index of a chunk (0 .. V - 1), the ``phase`` that
the schedules' instructions carry and that selects the pipe buffer ``phase * M + micro_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from attnres_dist.errors import ConfigError
from attnres_dist.pipeline.partition import compute_parts

PLACEMENTS = ("looped", "vshape")


def chunk_rank(placement: str, P: int, V: int, chunk: int) -> int:
    """The rank that holds ``chunk``."""
    C = P * V
    if not 0 <= chunk < C:
        raise ValueError(f"chunk {chunk} outside 0..{C - 1}")
    if placement == "looped":
        return chunk % P
    if placement == "vshape":
        return chunk if chunk < P else C - 1 - chunk
    raise ValueError(f"unknown placement {placement!r}; allowed: {', '.join(PLACEMENTS)}")


def rank_chunks(placement: str, P: int, V: int, rank: int) -> list[int]:
    """The chunks of ``rank`` in phase order (phase i = the i-th in execution order)."""
    return [c for c in range(P * V) if chunk_rank(placement, P, V, c) == rank]


@dataclass(frozen=True)
class VirtualLayout:
    """C = P * V chunks over P ranks, and the model parts each chunk owns.

    ``parts`` is DeepSpeed's partition list over the C chunks: chunk c owns model-part indices
    ``parts[c] .. parts[c + 1] - 1`` of ``[embedding, layer_0 .. layer_{n-1}, final, head]``.
    """

    placement: str
    P: int
    V: int
    num_layers: int
    parts: tuple[int, ...]
    tied: bool = True

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r}")
        if self.P < 2 or self.V < 2:
            raise ValueError(f"virtual stages need P >= 2 and V >= 2, got P={self.P}, V={self.V}")
        if self.placement == "vshape" and self.V != 2:
            raise ValueError(f"the V shape has exactly 2 chunks per rank, got V={self.V}")
        if len(self.parts) != self.C + 1 or self.parts[-1] != self.num_layers + 3:
            raise ValueError(f"parts {self.parts} do not cut {self.num_layers} layers in {self.C}")
        if any(a >= b for a, b in zip(self.parts, self.parts[1:], strict=False)):
            raise ValueError(f"parts {self.parts} leave a chunk with no model part")

    @property
    def C(self) -> int:
        return self.P * self.V

    def rank_of(self, chunk: int) -> int:
        return chunk_rank(self.placement, self.P, self.V, chunk)

    def chunks_of(self, rank: int) -> list[int]:
        return rank_chunks(self.placement, self.P, self.V, rank)

    def phase_of(self, chunk: int) -> int:
        """The rank-local index of ``chunk`` (the instructions' ``phase``)."""
        return self.chunks_of(self.rank_of(chunk)).index(chunk)

    def chunk_at(self, rank: int, phase: int) -> int:
        return self.chunks_of(rank)[phase]

    def layers_of(self, chunk: int) -> range:
        """Transformer layers (0-based) owned by ``chunk``."""
        lo, hi = self.parts[chunk], self.parts[chunk + 1]
        return range(max(lo, 1) - 1, min(hi, self.num_layers + 1) - 1)

    def layers_before(self, chunk: int) -> int:
        """Transformer layers applied before ``chunk`` starts."""
        return min(max(self.parts[chunk] - 1, 0), self.num_layers)

    def starts_with_head(self, chunk: int) -> bool:
        """True if ``chunk`` begins after the final aggregation (its input is the hidden state)."""
        return self.parts[chunk] == self.num_layers + 2

    @property
    def embedding_rank(self) -> int:
        return self.rank_of(0)

    @property
    def head_rank(self) -> int:
        return self.rank_of(self.C - 1)

    @cached_property
    def tied_ranks(self) -> tuple[int, ...]:
        """Ranks holding a copy of the tied embedding (one rank: no gradient exchange)."""
        if not self.tied:
            return ()
        return tuple(sorted({self.embedding_rank, self.head_rank}))

    def is_local(self, chunk: int) -> bool:
        """True if ``chunk`` hands over to ``chunk + 1`` on its own rank (the V's turn)."""
        return self.rank_of(chunk) == self.rank_of(chunk + 1)

    def describe_chunk(self, chunk: int) -> str:
        names = []
        lo, hi = self.parts[chunk], self.parts[chunk + 1]
        if lo == 0:
            names.append("embedding")
        layers = self.layers_of(chunk)
        if len(layers) == 1:
            names.append(f"layer {layers[0]}")
        elif layers:
            names.append(f"layers {layers[0]}-{layers[-1]}")
        if lo <= self.num_layers + 1 < hi:
            names.append("final aggregation")
        if lo <= self.num_layers + 2 < hi:
            names.append("head + loss")
        return f"chunk {chunk} (" + ", ".join(names) + ")"


def chunk_parts(model, C: int, partition, vocab_size: int) -> list[int]:
    """DeepSpeed ``parts`` over C chunks, with the rules the trainer applies over P stages."""
    n = model.num_layers
    if n < C:
        raise ConfigError(
            "model.num_layers",
            f"got {n}; {C} pipeline chunks (ranks x virtual stages) need at least {C} layers "
            "(one per chunk)",
        )
    if isinstance(partition, list):
        if len(partition) != C or any(k < 1 for k in partition) or sum(partition) != n:
            raise ConfigError(
                "parallel.partition",
                f"got {partition}; need {C} positive layer counts (one per chunk) summing to "
                f"model.num_layers={n}",
            )
    return compute_parts(model, C, partition, vocab_size)


def build_layout(
    model, P: int, V: int, placement: str, partition="uniform", vocab_size: int = 256
) -> VirtualLayout:
    """The layout of a model config (``ModelConfig``) over P ranks x V virtual stages."""
    parts = chunk_parts(model, P * V, partition, vocab_size)
    return VirtualLayout(placement, P, V, model.num_layers, tuple(parts), model.tie_embeddings)
