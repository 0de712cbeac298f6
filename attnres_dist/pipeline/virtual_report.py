"""Text for ``check-config`` about a virtual layout: chunks per rank and each transition's payload.

``format_virtual_plan`` renders a ``CachePlan``: which chunks (and model parts) each rank holds,
where the tied embedding's copies live, then one markdown row per hand-over with the naive and
the cached payload (shape and bytes per micro-batch, one way), and the totals.
"""

from __future__ import annotations

from attnres_dist.pipeline.stage_cache_plan import CachePlan


def _blocks(indices: tuple[int, ...]) -> str:
    if not indices:
        return "none"
    names = ["b0" if i == 0 else f"b{i}" for i in indices]
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def format_virtual_plan(plan: CachePlan) -> str:
    lay = plan.layout
    name = "looped interleaved" if lay.placement == "looped" else "DualPipeV (V shape)"
    lines = [f"{name}: {lay.P} ranks x {lay.V} = {lay.C} chunks; {plan.block_plan.describe()}"]
    for rank in range(lay.P):
        held = "; ".join(lay.describe_chunk(c) for c in lay.chunks_of(rank))
        lines.append(f"  rank {rank}: {held}")
    if lay.tied_ranks:
        where = " and ".join(f"rank {r}" for r in lay.tied_ranks)
        copies = "one shared copy on" if len(lay.tied_ranks) == 1 else "copies on"
        lines.append(f"  tied embedding: {copies} {where}")
    lines += [
        "",
        "| transition | after layers | naive blocks | naive shape | naive bytes "
        "| cached blocks | cached shape | cached bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in plan.transitions:
        if t.kind == "local":
            row = f"| {t.name} | {t.layers_before} | stays on the rank | - | 0 | - | - | 0 |"
            lines.append(row)
            continue
        partial = " + partial" if t.partial else ""
        naive, cached = _blocks(t.naive_blocks), _blocks(t.cached_blocks)
        if t.kind == "hidden":
            naive = cached = "final hidden state"
            partial = ""
        lines.append(
            f"| {t.name} | {t.layers_before} | {naive}{partial} | {list(t.shape(False))} | "
            f"{t.nbytes(False):,} | {cached}{partial} | {list(t.shape(True))} | "
            f"{t.nbytes(True):,} |"
        )
    naive, cached = plan.bytes_per_micro_batch(False), plan.bytes_per_micro_batch(True)
    ratio = cached / naive if naive else 1.0
    lines += [
        "",
        f"per micro-batch, each way: naive {naive:,} bytes, cached {cached:,} bytes "
        f"({ratio:.0%}); widest payload {plan.peak_width(False)} -> {plan.peak_width(True)} "
        "tensors",
    ]
    return "\n".join(lines)
