"""Text for ``check-config`` about a virtual layout: chunks per rank and each transition's payload.

``plan_for_config`` builds a run's ``CachePlan`` (the layout of ``parallel.schedule``, the
payload's dtype). ``format_virtual_plan`` renders it: which chunks (and model parts) each rank
holds, where the tied embedding's copies live, then one markdown row per hand-over with the
naive and the cached payload (shape and bytes per micro-batch, one way; the one that
``parallel.cross_stage_cache`` sends is marked), and the totals. ``plan_totals`` sets the
completed blocks the plan sends next to the closed forms: the paper's for the looped layout,
``C (C - 1) / 2 N_p`` naive and ``P (P - 1) / 2 N_p + (V - 1) P^2 N_p`` cached (a rank keeps
what it received), and the plan's own accounting, which also keeps what a rank produced:
``(V - 1) P (P - 1) N_p`` for the later rounds. They hold exactly when every chunk closes the
same N_p blocks and no cut falls inside a block; the plan's counts are exact for any layout.
"""

from __future__ import annotations

from fractions import Fraction

from attnres_dist.pipeline.stage_cache_plan import (
    CachePlan,
    looped_cached_formula,
    naive_formula,
    vshape_cached_formula,
)


def plan_for_config(cfg, vocab_size: int, itemsize: int = 4) -> CachePlan:
    """The cache plan of a run whose ``parallel.schedule`` is dualpipev or interleaved (the
    layout and plan the engine is built with, ``virtual_setup``)."""
    from attnres_dist.pipeline import virtual_setup

    layout = virtual_setup.layout_of(cfg, vocab_size)
    return virtual_setup.cache_plan(cfg, layout, itemsize)


def plan_totals(plan: CachePlan) -> dict | None:
    """Completed blocks sent per micro-batch (b_0 aside, as the paper counts) and the formulas.

    None for a plan with no blocks (baseline). ``aligned``: every chunk closes N_p blocks and
    no partial block crosses, the formulas' assumption.
    """
    lay, bp = plan.layout, plan.block_plan
    if bp.mode == "baseline":
        return None
    C, P, V = lay.C, lay.P, lay.V
    blocks = plan.transitions
    n = bp.state_after(2 * bp.num_layers)[0] - 1  # completed blocks, b_0 aside
    n_p = Fraction(n, C)
    moving = [t for t in blocks if t.kind == "blocks"]
    aligned = n_p.denominator == 1 and all(
        not t.partial and t.completed == 1 + (t.src_chunk + 1) * n_p for t in moving
    )
    local = sum(1 for t in blocks if t.kind == "local")
    turn = lay.P if local else None  # the V's turn keeps P chunks' blocks on its rank
    out = {
        "P": P,
        "V": V,
        "C": C,
        "N": n,
        "N_p": n_p,
        "aligned": aligned,
        "naive_blocks": sum(len([b for b in t.naive_blocks if b]) for t in moving),
        "cached_blocks": sum(len([b for b in t.cached_blocks if b]) for t in moving),
        "naive_formula": Fraction(naive_formula(C, 1, turn)) * n_p,
        "block_bytes": plan.block_bytes(),
    }
    if lay.placement == "looped":
        out["paper_cached_formula"] = Fraction(looped_cached_formula(P, V, 1, False)) * n_p
        out["cached_formula"] = Fraction(looped_cached_formula(P, V, 1, True)) * n_p
    else:
        out["cached_formula"] = Fraction(vshape_cached_formula(P, 1)) * n_p
    return out


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.2f}"


def format_totals(totals: dict) -> list[str]:
    """Lines setting the plan's completed-block counts next to the closed forms."""
    t = totals
    exact = "exact here" if t["aligned"] else "approximate here: blocks do not end at chunk cuts"
    looped = "paper_cached_formula" in t
    naive_name = "C(C-1)/2 N_p" if looped else "C(C-1)/2 N_p - P N_p (the turn stays local)"
    lines = [
        f"completed blocks sent per micro-batch, b0 aside (N = {t['N']} blocks, N_p = "
        f"{_num(t['N_p'])} per chunk; formulas {exact}; x {t['block_bytes']:,} bytes each):",
        f"  naive:  {t['naive_blocks']}; formula {naive_name} = {_num(t['naive_formula'])}",
    ]
    if looped:
        return lines + [
            f"  cached: {t['cached_blocks']}; formula P(P-1)/2 N_p + (V-1) P(P-1) N_p = "
            f"{_num(t['cached_formula'])} (a rank keeps what it received and produced)",
            "          the paper's P(P-1)/2 N_p + (V-1) P^2 N_p = "
            f"{_num(t['paper_cached_formula'])} (a rank keeps what it received)",
        ]
    return lines + [
        f"  cached: {t['cached_blocks']}; formula 3 P(P-1)/2 N_p = {_num(t['cached_formula'])} "
        "(out like a first round; back, rank q lacks 2 (P-1-q) chunks' blocks)",
    ]


def _blocks(indices: tuple[int, ...]) -> str:
    if not indices:
        return "none"
    names = ["b0" if i == 0 else f"b{i}" for i in indices]
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def format_virtual_plan(plan: CachePlan, cross_stage_cache: bool | None = None) -> str:
    """The plan as text; ``cross_stage_cache`` (the config's choice) marks the payload sent."""
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
    if cross_stage_cache is not None:
        sent = "cached" if cross_stage_cache else "naive"
        lines.append(
            f"  parallel.cross_stage_cache: {str(cross_stage_cache).lower()}: the {sent} "
            "payload is sent (columns marked *)"
        )
    mark_naive = " *" if cross_stage_cache is False else ""
    mark_cached = " *" if cross_stage_cache else ""
    lines += [
        "",
        f"| transition | after layers | naive blocks | naive shape | naive bytes{mark_naive} "
        f"| cached blocks | cached shape | cached bytes{mark_cached} |",
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
    totals = plan_totals(plan)
    if totals is not None:
        lines += format_totals(totals)
    return "\n".join(lines)
