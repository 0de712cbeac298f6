"""The profiler's view of virtual-stage schedules: bytes per transition and the bubble.

With ``parallel.schedule`` dualpipev or interleaved a pair of ranks carries several hand-overs
(chunk c -> c + 1 for every c whose neighbours sit on those ranks), each with its own payload.
The prediction per transition is the run's ``CachePlan`` (``virtual_report.plan_for_config``):
the naive and the cached payload, and the one ``parallel.cross_stage_cache`` sends; the wire
tap records every queued tensor with the transition it belongs to, so predicted and measured
bytes are compared per transition and direction (the gradient has the payload's shape), and
the totals per micro-batch are set next to the closed forms (``virtual_report.plan_totals``).

The bubble, for every schedule (1F1B too): measured, per step, as the idle fraction of the
pipeline ranks (one data- and tensor-parallel chain) between the first pass's start and the
last pass's end, ``1 - busy / (P span)``; theoretical, from ``schedule_sim`` running the same
instruction streams with free communication, at the textbook costs (a chunk's backward twice
its forward, the whole model's forward costing 1 per rank) and at the measured median pass
costs.
"""

from __future__ import annotations

from fractions import Fraction

from attnres_dist.profile.analysis import quantile, summary


def sends_cached(ds_engine, cfg) -> bool:
    """Whether the engine's chunk boundary sends the cached payload (else the naive one).

    The boundary decides (``parallel.cross_stage_cache`` asks for the cache, the boundary the
    engine was built with says what it sends); the config's choice where it does not say.
    """
    boundary = getattr(ds_engine, "boundary", None)
    return bool(getattr(boundary, "cached", cfg.parallel.cross_stage_cache))


def transition_specs(plan, cached: bool) -> list[dict]:
    """One dict per hand-over that crosses ranks: naive, cached and the active payload."""
    out = []
    for t in plan.transitions:
        if t.kind == "local":
            continue
        out.append(
            {
                "src_chunk": t.src_chunk,
                "dst_chunk": t.dst_chunk,
                "src_rank": t.src_rank,
                "dst_rank": t.dst_rank,
                "layers_before": t.layers_before,
                "kind": t.kind,
                "name": t.name,
                "naive_shape": list(t.shape(False)),
                "naive_bytes": t.nbytes(False),
                "cached_shape": list(t.shape(True)),
                "cached_bytes": t.nbytes(True),
                "cached": cached,
                "predicted_bytes": t.nbytes(cached),
                "predicted_shape": list(t.shape(cached)),
            }
        )
    return out


def transition_rows(specs: list[dict], ranks: list[dict], dims, micro_batches: int) -> list[dict]:
    """Each transition's spec with what the tap saw, per direction (both ends, all steps)."""
    rows = []
    for spec in specs:
        row = dict(spec)
        for direction in ("forward", "backward"):
            mine = [
                t
                for r in ranks
                if dims.coords(r["rank"])[1:] == (0, 0)
                for t in r["transfers"]
                if t.get("chunk", -1) == spec["src_chunk"] and t["direction"] == direction
            ]
            measured = sorted({t["nbytes"] for t in mine})
            shapes = sorted({tuple(s) for t in mine for s in t["shapes"]})
            per_step: dict[tuple[int, str], int] = {}
            for t in mine:
                per_step[(t["step"], t["op"])] = per_step.get((t["step"], t["op"]), 0) + 1
            mbs = sorted({t["micro_batch"] for t in mine})
            row[direction] = {
                "measured_bytes": measured[0] if len(measured) == 1 else measured,
                "measured_shapes": [list(s) for s in shapes],
                "bytes_equal": measured == [spec["predicted_bytes"]],
                "sends": sum(1 for t in mine if t["op"] == "send"),
                "recvs": sum(1 for t in mine if t["op"] == "recv"),
                "per_step_each_end": sorted(set(per_step.values())),
                "micro_batches_seen": mbs == list(range(micro_batches)),
                "commit_s": summary(t["end"] - t["start"] for t in mine if t["op"] == "recv"),
            }
        rows.append(row)
    return rows


def _chain(ranks: list[dict], dims) -> list[dict]:
    return [r for r in ranks if dims.coords(r["rank"])[1:] == (0, 0)]


def measured_bubble(ranks: list[dict], dims) -> dict:
    """Per measured step: ``1 - busy / (P span)`` over the forward and backward passes."""
    chain = _chain(ranks, dims)
    steps = sorted({e["step"] for r in chain for e in r["events"]})
    values = []
    for step in steps:
        passes = [
            e
            for r in chain
            for e in r["events"]
            if e["step"] == step and e["kind"] in ("forward", "backward")
        ]
        if not passes:
            continue
        busy = sum(e["end"] - e["start"] for e in passes)
        span = max(e["end"] for e in passes) - min(e["start"] for e in passes)
        values.append(1.0 - busy / (len(chain) * span) if span > 0 else 0.0)
    return summary(values) | {"per_step": values}


def pass_costs(ranks: list[dict], dims) -> tuple[float, float]:
    """Median forward and backward pass (one chunk, one micro-batch) over the chain's ranks."""
    chain = _chain(ranks, dims)
    fwd = [e["end"] - e["start"] for r in chain for e in r["events"] if e["kind"] == "forward"]
    bwd = [e["end"] - e["start"] for r in chain for e in r["events"] if e["kind"] == "backward"]
    return quantile(fwd, 0.5), quantile(bwd, 0.5)


def theoretical_bubble(schedule: str, P: int, V: int, M: int, costs=None) -> float:
    """The schedule's bubble with free communication (``schedule_sim``).

    ``costs`` (forward, backward) per chunk pass; None: the textbook 1 : 2 with the whole
    model's forward costing 1 per rank (1 / V per chunk).
    """
    from attnres_dist.pipeline.schedule_exec import build_schedule
    from attnres_dist.pipeline.schedule_sim import simulate

    built = [build_schedule(schedule, P, r, M, V) for r in range(P)]
    _, chunk_of, C, phased = built[0]
    per_rank = C // P
    if costs is None:
        fwd, bwd = Fraction(1, per_rank), Fraction(2, per_rank)
    else:
        fwd, bwd = Fraction(costs[0]), Fraction(costs[1])
    result = simulate([b[0] for b in built], chunk_of, C, M, fwd, bwd, phased=phased)
    return float(result.bubble)


def bubble_section(cfg, ranks: list[dict], dims) -> dict:
    """Measured bubble next to the theoretical one, for the run's schedule."""
    p = cfg.parallel
    V = p.virtual_stages if p.schedule == "interleaved" else 2
    M = cfg.grad_accum_steps
    fwd, bwd = pass_costs(ranks, dims)
    at_costs = None
    if fwd == fwd and bwd == bwd and fwd > 0:  # not NaN: passes were timed
        at_costs = theoretical_bubble(p.schedule, dims.pp, V, M, (fwd, bwd))
    return {
        "schedule": p.schedule,
        "virtual_stages": V if p.schedule != "1f1b" else 1,
        "micro_batches": M,
        "theoretical": theoretical_bubble(p.schedule, dims.pp, V, M),
        "theoretical_at_measured_costs": at_costs,
        "forward_pass_s": fwd,
        "backward_pass_s": bwd,
        "measured": measured_bubble(ranks, dims),
    }


def expected_trace_bytes(specs: list[dict], rank_stage: int, M: int, steps: int) -> dict:
    """Bytes one pipeline rank sends and receives in ``steps`` steps, from the transitions."""
    send = recv = 0
    for s in specs:
        if s["src_rank"] == rank_stage:  # activations out, gradients in
            send += s["predicted_bytes"]
            recv += s["predicted_bytes"]
        if s["dst_rank"] == rank_stage:
            recv += s["predicted_bytes"]
            send += s["predicted_bytes"]
    return {"send": send * M * steps, "recv": recv * M * steps}


# -- rendering ---------------------------------------------------------------------------------


def transition_table(rows: list[dict]) -> str:
    out = [
        "| transition | after layers | naive shape | naive bytes | cached shape | cached bytes "
        "| predicted (sent) | measured fwd | measured bwd | equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sent = "cached" if r["cached"] else "naive"

        def fmt(x):
            v = x["measured_bytes"]
            return ", ".join(f"{b:,}" for b in v) if isinstance(v, list) else f"{v:,}"

        equal = r["forward"]["bytes_equal"] and r["backward"]["bytes_equal"]
        out.append(
            f"| {r['name']} | {r['layers_before']} | {r['naive_shape']} | "
            f"{r['naive_bytes']:,} | {r['cached_shape']} | {r['cached_bytes']:,} | "
            f"{r['predicted_bytes']:,} ({sent}) | {fmt(r['forward'])} | {fmt(r['backward'])} | "
            f"{'yes' if equal else 'NO'} |"
        )
    return "\n".join(out)


def bubble_lines(b: dict) -> list[str]:
    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    m = b["measured"]
    name = {"1f1b": "1F1B", "dualpipev": "DualPipeV", "interleaved": "interleaved 1F1B"}
    label = name.get(b["schedule"], b["schedule"])
    if b["schedule"] == "interleaved":
        label += f" (V = {b['virtual_stages']})"
    return [
        "| schedule | micro-batches | theoretical bubble (backward = 2 forward) | theoretical "
        "at the measured pass costs | measured bubble median (p90) |",
        "|---|---|---|---|---|",
        f"| {label} | {b['micro_batches']} | {pct(b['theoretical'])} | "
        f"{pct(b['theoretical_at_measured_costs'])} | {pct(m['median'])} ({pct(m['p90'])}) |",
    ]


def mode_transitions(cfg, vocab_size: int, itemsize: int, cached: bool) -> dict[str, list[dict]]:
    """The sent payload per transition for baseline, Full and Block AttnRes of the same model.

    Dicts shaped like ``BoundarySpec.to_dict`` (sender / receiver = the chunks) plus a
    ``label``, for the bytes-per-boundary plot and table.
    """
    import dataclasses

    from attnres_dist.pipeline.virtual_report import plan_for_config

    out = {}
    m = cfg.model
    for mode in ("baseline", "full", "block"):
        size = min(m.attnres.block_size, 2 * m.num_layers)
        attnres = dataclasses.replace(m.attnres, mode=mode, block_size=size)
        variant = dataclasses.replace(cfg, model=dataclasses.replace(m, attnres=attnres))
        plan = plan_for_config(variant, vocab_size, itemsize)
        rows = []
        for t in transition_specs(plan, cached):
            shape = t["predicted_shape"]
            rows.append(
                {
                    "sender": t["src_chunk"],
                    "receiver": t["dst_chunk"],
                    "label": f"chunk {t['src_chunk']}->{t['dst_chunk']}",
                    "num_tensors": shape[0] if t["kind"] == "blocks" else 1,
                    "bytes_forward": t["predicted_bytes"],
                }
            )
        label = mode if mode != "block" else f"block (S={size})"
        out[label] = rows
    return out


def itemsize(trainer) -> int:
    return trainer.runtime.activation_dtype.itemsize


def virtual_section(trainer, transitions, ranks, dims, M) -> dict:
    """Per transition predicted (naive, cached, sent) vs measured, and the totals."""
    from attnres_dist.pipeline.virtual_report import format_totals, plan_for_config, plan_totals

    cfg = trainer.cfg
    plan = plan_for_config(cfg, trainer.builder.vocab_size, itemsize(trainer))
    totals = plan_totals(plan)
    return {
        "schedule": cfg.parallel.schedule,
        "placement": plan.layout.placement,
        "P": plan.layout.P,
        "V": plan.layout.V,
        "chunks_of_rank": {r: plan.layout.chunks_of(r) for r in range(plan.layout.P)},
        "cross_stage_cache": cfg.parallel.cross_stage_cache,
        "sends_cached": bool(transitions and transitions[0]["cached"]),
        "transitions": transition_rows(transitions, ranks, dims, M),
        "bytes_per_micro_batch": {
            "naive": plan.bytes_per_micro_batch(False),
            "cached": plan.bytes_per_micro_batch(True),
            "sent": plan.bytes_per_micro_batch(bool(transitions and transitions[0]["cached"])),
        },
        "peak_width": {"naive": plan.peak_width(False), "cached": plan.peak_width(True)},
        "totals": None if totals is None else {k: _plain(v) for k, v in totals.items()},
        "totals_text": [] if totals is None else format_totals(totals),
    }


def _plain(value):
    """Fractions as floats (integers stay integers) for strict JSON."""
    if isinstance(value, Fraction):
        return value.numerator if value.denominator == 1 else float(value)
    return value


def boundary_lines(v: dict, table: str, verdict: str) -> list[str]:
    """The report's transitions section."""
    b = v["bytes_per_micro_batch"]
    chunks = "; ".join(
        f"rank {r}: chunks {', '.join(map(str, cs))}" for r, cs in v["chunks_of_rank"].items()
    )
    sent = "cached" if v["sends_cached"] else "naive"
    return [
        f"## Transitions (per micro-batch; {v['schedule']}, {v['P']} ranks x {v['V']} chunks)",
        "",
        chunks + ".",
        "",
        table,
        "",
        f"parallel.cross_stage_cache = {str(v['cross_stage_cache']).lower()}; the engine's "
        f"chunk boundary sends the {sent} payload. Bytes measured on the wire (every tensor "
        f"queued for a batched commit) {verdict} the cache plan's prediction in both "
        "directions. Per micro-batch, "
        f"one way: naive {b['naive']:,}, cached {b['cached']:,}, sent {b['sent']:,} bytes; "
        f"widest payload {v['peak_width']['naive']} -> {v['peak_width']['cached']} tensors.",
        "",
    ]


def schedule_title(bubble: dict) -> str:
    """The timeline plot's title for the run's schedule."""
    if bubble["schedule"] == "1f1b":
        return "Pipeline schedule per rank (1F1B, DeepSpeed)"
    if bubble["schedule"] == "dualpipev":
        return "Pipeline schedule per rank (DualPipeV, DeepSpeed)"
    return f"Pipeline schedule per rank (interleaved 1F1B, V = {bubble['virtual_stages']})"


def bubble_name(bubble: dict) -> str:
    return {"1f1b": "1F1B", "dualpipev": "DualPipeV", "interleaved": "interleaved"}[
        bubble["schedule"]
    ]
