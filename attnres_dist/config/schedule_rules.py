"""Rules of the pipeline schedule: which schedule, how many model chunks, enough work for it.

``1f1b`` is one model chunk per rank. ``dualpipev`` puts two chunks on every rank in a V
(rank r holds chunks r and 2P - 1 - r) and ``interleaved`` V >= 2 chunks on every rank in a loop
(chunk c on rank c mod P). Both need at least two ranks, one transformer layer per chunk, and
enough micro-batches per step: DualPipeV at least 2P (DeepSpeed's own condition), interleaved at
least P with no last group of fewer than P (Megatron-Core's conditions for its schedule table).
The per-sample document options travel with the activations only under 1F1B.
"""

from __future__ import annotations

from attnres_dist.config.schema import Config
from attnres_dist.errors import ConfigError

SCHEDULES = ("1f1b", "dualpipev", "interleaved")


def chunks_per_rank(cfg: Config) -> int:
    """Model chunks each pipeline rank holds under the configured schedule."""
    p = cfg.parallel
    if p.schedule == "dualpipev":
        return 2
    return p.virtual_stages


def validate_schedule(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    if p.schedule not in SCHEDULES:
        raise ConfigError(
            "parallel.schedule", f"got {p.schedule!r}; allowed: {', '.join(SCHEDULES)}"
        )
    if p.virtual_stages < 1:
        raise ConfigError("parallel.virtual_stages", f"got {p.virtual_stages}; must be >= 1")
    if p.virtual_stages > 1 and p.schedule != "interleaved":
        raise ConfigError(
            "parallel.virtual_stages",
            f"got {p.virtual_stages} with parallel.schedule={p.schedule}; more than one chunk per "
            "rank needs parallel.schedule=interleaved (dualpipev always holds 2)",
        )
    if p.schedule == "1f1b":
        return
    if p.pp < 2:
        raise ConfigError(
            "parallel.schedule", f"{p.schedule} needs parallel.pp >= 2 ranks, got pp={p.pp}"
        )
    if p.schedule == "interleaved" and p.virtual_stages < 2:
        raise ConfigError(
            "parallel.virtual_stages",
            f"got {p.virtual_stages}; parallel.schedule=interleaved needs >= 2 chunks per rank",
        )
    for name in ("reset_attention_mask", "reset_position_ids"):
        if getattr(cfg.data, name):
            raise ConfigError(
                f"data.{name}",
                f"is true with parallel.schedule={p.schedule}; per-sample document masks and "
                "positions travel with the activations only under parallel.schedule=1f1b: use "
                "1f1b or set it to false",
            )
    chunks = p.pp * chunks_per_rank(cfg)
    if m.num_layers < chunks:
        raise ConfigError(
            "model.num_layers",
            f"got {m.num_layers}; {p.schedule} with pp={p.pp} cuts {chunks} chunks and needs at "
            f"least one layer per chunk; lower parallel.pp or add layers",
        )
    micro = cfg.grad_accum_steps
    if p.schedule == "dualpipev" and micro < 2 * p.pp:
        raise ConfigError(
            "train.global_batch_size",
            f"gives {micro} micro-batches per step; dualpipev needs >= 2 * pp = "
            f"{2 * p.pp}: raise global_batch_size or lower micro_batch_size",
        )
    if p.schedule == "interleaved" and micro % p.pp != 0:
        raise ConfigError(
            "train.global_batch_size",
            f"gives {micro} micro-batches per step; interleaved needs a multiple of "
            f"pp = {p.pp} (Megatron's groups of pp micro-batches): raise global_batch_size or "
            "lower micro_batch_size",
        )
