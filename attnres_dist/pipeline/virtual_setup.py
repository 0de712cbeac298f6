"""From a run config to the parts of a virtual-stage pipeline: layout, plan, boundary, module.

``parallel.schedule: dualpipev`` is the V shape (2 chunks per rank), ``interleaved`` the looped
layout with ``parallel.virtual_stages`` chunks per rank. The cache plan (``stage_cache_plan``)
gives every phase's static payload shapes, naive or cached, whichever the rank's chunk
boundary sends. ``make_boundary`` chooses the boundary: the cross-stage cache
(``stage_cache.CachedBoundary``) with ``parallel.cross_stage_cache: true``, the naive contract
without.
"""

from __future__ import annotations

from attnres_dist.config import Config
from attnres_dist.config.schedule_rules import chunks_per_rank
from attnres_dist.model.gpt import ModelBuilder
from attnres_dist.pipeline.chunk_boundary import NaiveBoundary
from attnres_dist.pipeline.stage_cache import CachedBoundary
from attnres_dist.pipeline.stage_cache_plan import CachePlan
from attnres_dist.pipeline.virtual_layout import VirtualLayout, build_layout


def layout_of(cfg: Config, vocab_size: int) -> VirtualLayout:
    p = cfg.parallel
    placement = "vshape" if p.schedule == "dualpipev" else "looped"
    return build_layout(cfg.model, p.pp, chunks_per_rank(cfg), placement, p.partition, vocab_size)


def payload_dtype(runtime):
    import torch

    return torch.float32 if runtime is None else runtime.activation_dtype


def cache_plan(cfg: Config, layout: VirtualLayout, itemsize: int = 4) -> CachePlan:
    m = cfg.model
    return CachePlan(
        layout,
        m.block_plan(),
        cfg.local_seq_length,
        cfg.train.micro_batch_size,
        m.hidden_size,
        itemsize,
    )


def make_boundary(cfg: Config, layout: VirtualLayout, plan: CachePlan, stage: int):
    """The rank's chunk boundary and a line saying which one it is."""
    if cfg.parallel.cross_stage_cache:
        return CachedBoundary(plan, stage), (
            f"chunk boundary: cross-stage cache ({len(plan.entries_of(stage))} cached blocks "
            f"per micro-batch on this rank; widest payload {plan.peak_width(True)} blocks, "
            f"naive {plan.peak_width(False)})"
        )
    boundary = NaiveBoundary(layout, plan.block_plan)
    return boundary, "chunk boundary: naive contract (parallel.cross_stage_cache=false)"


def describe(cfg: Config, layout: VirtualLayout) -> str:
    name = "DualPipeV (V shape)" if layout.placement == "vshape" else "interleaved (looped)"
    return f"schedule: {cfg.parallel.schedule}, {name}, {layout.P} ranks x {layout.V} chunks"


def build_module(cfg: Config, builder: ModelBuilder, topology, stage: int):
    """(module, this rank's per-phase payload shapes, start-up line) of a virtual schedule."""
    from attnres_dist.pipeline.virtual_module import VirtualPipelineModule

    layout = layout_of(cfg, builder.vocab_size)
    itemsize = payload_dtype(builder.runtime).itemsize
    plan = cache_plan(cfg, layout, itemsize)
    boundary, note = make_boundary(cfg, layout, plan, stage)
    module = VirtualPipelineModule(
        builder,
        layout,
        topology,
        boundary,
        cfg.parallel.recompute,
        cfg.parallel.recompute_interval,
    )
    shapes = plan.phase_shapes(stage, cached=boundary.cached)
    return module, shapes, f"{describe(cfg, layout)}; {note}"
