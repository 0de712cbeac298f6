"""ParallelDims: the (pp, dp, tp) layout of a run and where this rank sits in it.

Rank order is tensor-parallel fastest, then data-parallel, then pipeline, which is both
Megatron-Core's ``parallel_state`` default and DeepSpeed's ``PipeModelDataParallelTopology``
(axes pipe, data, model). Code asks this object for coordinates instead of doing rank
arithmetic of its own.

Expert parallelism (``ep``) adds no ranks: as in Megatron-Core, each MoE layer's experts are
split over ``ep`` consecutive data-parallel ranks (its expert rank order tp-ep-dp-pp), and the
ranks holding the same experts (every ``ep``-th data-parallel rank) form the expert
data-parallel group that averages their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnres_dist.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def check_world_size(self, world_size: int, launcher: str = "launcher") -> None:
        if world_size != self.world_size:
            raise ConfigError(
                "parallel",
                f"pp * dp * tp = {self.pp} * {self.dp} * {self.tp} = {self.world_size} but "
                f"{world_size} processes were started ({launcher}); change parallel.* or the "
                "process count",
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline stage, data-parallel rank, tensor-parallel rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """(expert-parallel rank, expert data-parallel rank) of a global rank."""
        dp_rank = self.coords(rank)[1]
        return dp_rank % self.ep, dp_rank // self.ep

    def describe(self) -> str:
        experts = f" (ep={self.ep})" if self.ep > 1 else ""
        return f"pp={self.pp} x dp={self.dp}{experts} x tp={self.tp} = {self.world_size} ranks"
