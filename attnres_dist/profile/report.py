"""Assemble the profile (``comm_profile.json``), render ``comm_report.md``, draw the plots.

``build_profile`` joins the analysed measurements with what needs no measurement: the
contract's predicted bytes, the link models, the analytic volumes and the what-if table, the
baseline/Full/Block comparison, and an independent byte count from the torch.profiler traces
(``gloo:send`` / ``gloo:recv`` events). ``key_table`` is the per-boundary table printed at the
end of a run and placed first in the report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from attnres_dist.profile import plots, virtual
from attnres_dist.profile.analysis import analyze
from attnres_dist.profile.volumes import mode_specs, run_volumes


def _expected_trace_bytes(rows, stage: int, tp_rank: int, M: int, steps: int) -> dict:
    """gloo bytes one rank sends and receives in ``steps`` steps, from the boundary rows."""

    def wire(row, direction):
        return expected_wire_bytes_of(row, direction, tp_rank)

    send = recv = 0
    for row in rows:
        if row["sender"] == stage:  # activations out, gradients in
            send += wire(row, "forward")
            recv += wire(row, "backward")
        if row["receiver"] == stage:
            recv += wire(row, "forward")
            send += wire(row, "backward")
    return {"send": send * M * steps, "recv": recv * M * steps}


def expected_wire_bytes_of(row: dict, direction: str, tp_rank: int) -> int:
    values = row[direction]["expected_wire_bytes_per_rank"]
    return values[min(tp_rank, len(values) - 1)] if len(values) > 1 else values[0]


def build_profile(
    trainer,
    opts,
    specs,
    links,
    ranks: list[dict],
    threads: int,
    partitioned: dict,
    transitions: list[dict] | None = None,
) -> dict:
    """``transitions``: virtual stages' hand-overs (``virtual.transition_specs``), else None."""
    cfg, dims = trainer.cfg, trainer.dims
    m, t = cfg.model, cfg.train
    M = cfg.grad_accum_steps
    tokens_per_step = t.global_batch_size * m.seq_length
    traces = {r["rank"]: r.pop("trace") for r in ranks}
    meta = {r["rank"]: r.pop("meta_bytes") for r in ranks}
    stray = sum(len(r.pop("stray")) for r in ranks)
    result = analyze(ranks, dims, specs, links, M, tokens_per_step, partitioned)
    vsection = None
    if transitions is not None:
        vsection = virtual.virtual_section(trainer, transitions, ranks, dims, M)
    for rank, trace in traces.items():
        if trace is None:
            continue
        stage, _, tp_rank = dims.coords(rank)
        if vsection is not None:
            expected = virtual.expected_trace_bytes(transitions, stage, M, trace["steps"])
        else:
            expected = _expected_trace_bytes(
                result["boundaries"], stage, tp_rank, M, trace["steps"]
            )
        trace["expected_bytes"] = expected
        trace["bytes_equal"] = (
            trace["gloo_send"]["bytes"] == expected["send"]
            and trace["gloo_recv"]["bytes"] == expected["recv"]
        )
    bubble = virtual.bubble_section(cfg, ranks, dims)
    for row in result["stages"]:  # the schedule's own, for every schedule
        row["bubble_theory"] = bubble["theoretical"]
    return {
        "config": {
            "model": m.block_plan().describe(),
            "mode": m.attnres.mode,
            "block_size": m.attnres.block_size,
            "num_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "seq_length": m.seq_length,
            "micro_batch_size": t.micro_batch_size,
            "micro_batches_per_step": M,
            "global_batch_size": t.global_batch_size,
            "pp": dims.pp,
            "dp": dims.dp,
            "tp": dims.tp,
            "partition": trainer.engine.parts,
            "threads_per_rank": threads,
            "run_dir": cfg.output.run_dir,
        },
        "run": {
            "warmup_steps": opts.warmup,
            "measured_steps": opts.steps,
            "trace_steps": opts.trace_steps,
            "tokens_per_step": tokens_per_step,
            "step_s": result["step_s"],
            "tokens_per_s": result["tokens_per_s"],
            "shape_metadata_bytes": meta,
            "p2p_calls_outside_instructions": stray,
        },
        "calibration": [link.to_dict() for link in links],
        "boundaries": result["boundaries"],
        "bytes_equal_contract": all(
            row[d]["bytes_equal"]
            for row in (vsection["transitions"] if vsection else result["boundaries"])
            for d in ("forward", "backward")
        ),
        "stages": result["stages"],
        "bubble_1f1b": (dims.pp - 1) / (M + dims.pp - 1),
        "bubble": bubble,
        "virtual": vsection,
        "volumes": run_volumes(cfg, specs, opts.what_ifs),
        "modes": (
            virtual.mode_transitions(
                cfg, trainer.builder.vocab_size, virtual.itemsize(trainer), vsection["sends_cached"]
            )
            if vsection
            else mode_specs(cfg, trainer.builder.vocab_size)
        ),
        "traces": {str(k): v for k, v in traces.items()},
        "timeline": result["timeline"],
        "files": {},
    }


def write_outputs(profile: dict, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "dir": str(run_dir),
        "profile": "comm_profile.json",
        "report": "comm_report.md",
        "timeline": plots.plot_timeline(
            profile["timeline"],
            run_dir / "timeline.png",
            title=virtual.schedule_title(profile["bubble"]),
        ).name,
        "boundary_bytes": plots.plot_boundary_bytes(
            profile["modes"], run_dir / "boundary_bytes.png"
        ).name,
        "stage_breakdown": plots.plot_stage_breakdown(
            profile["stages"],
            run_dir / "stage_breakdown.png",
            virtual.bubble_name(profile["bubble"]),
        ).name,
        "traces": sorted(tr["file"] for tr in profile["traces"].values() if tr),
    }
    profile["files"] = files
    text = json.dumps(_json_safe(profile), indent=1, allow_nan=False)
    (run_dir / "comm_profile.json").write_text(text)
    (run_dir / "comm_report.md").write_text(render(profile))


def _json_safe(value):
    """Strict JSON: tuples to lists, NaN and infinities to null."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# -- rendering ---------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * 1e3:.2f}"


def _rate(bps: float) -> str:
    if bps is None or math.isnan(bps):
        return "n/a"
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.1f} MB/s"


def _predicted(x: dict) -> str:
    """Contract bytes; with tensor parallelism also the per-rank slice DeepSpeed sends."""
    full = x["predicted_bytes_per_micro_batch"]
    wire = x["expected_wire_bytes_per_rank"]
    if wire == [full]:
        return f"{full:,}"
    return f"{full:,} (per tensor rank: {', '.join(f'{b:,}' for b in wire)})"


def _measured(x: dict) -> str:
    value = x["measured_bytes_per_micro_batch"]
    return ", ".join(f"{b:,}" for b in value) if isinstance(value, list) else f"{value:,}"


def key_table(profile: dict) -> str:
    if profile.get("virtual"):
        return virtual.transition_table(profile["virtual"]["transitions"])
    rows = [
        "| boundary | direction | k tensors (wire messages) | bytes / micro-batch predicted | "
        "measured | equal | "
        "transfers / step | send ms median / p90 | recv ms median / p90 | transfer ms median "
        "| achieved | model ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in profile["boundaries"]:
        for d, label in (("forward", "activations fwd"), ("backward", "gradients bwd")):
            x = b[d]
            rows.append(
                f"| {b['sender']} -> {b['receiver']} (after {b['layers_before']} layers) | "
                f"{label} | {b['num_tensors']} ({x['tensors_per_micro_batch']}) | "
                f"{_predicted(x)} | "
                f"{_measured(x)} | "
                f"{'yes' if x['bytes_equal'] else 'NO'} | {x['transfers_per_step']:g} | "
                f"{_ms(x['send_s']['median'])} / {_ms(x['send_s']['p90'])} | "
                f"{_ms(x['recv_s']['median'])} / {_ms(x['recv_s']['p90'])} | "
                f"{_ms(x['transfer_s']['median'])} | {_rate(x['achieved_Bps'])} | "
                f"{_ms(x['model_s'])} |"
            )
    return "\n".join(rows)


def _stage_table(profile: dict) -> str:
    name = virtual.bubble_name(profile["bubble"])
    rows = [
        "| stage | step ms | forward ms (per micro-batch) | backward ms (per micro-batch) | "
        f"transfer ms | other ms | idle ms | idle fraction | {name} bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in profile["stages"]:
        rows.append(
            f"| {s['stage']} | {_ms(s['step_s'])} | {_ms(s['forward_s'])} "
            f"({_ms(s['forward_per_micro_batch_s'])}) | {_ms(s['backward_s'])} "
            f"({_ms(s['backward_per_micro_batch_s'])}) | {_ms(s['transfer_s'])} | "
            f"{_ms(s['other_s'])} | {_ms(s['idle_s'])} | {s['idle_fraction']:.1%} | "
            f"{s.get('bubble_theory', s['bubble_1f1b']):.1%} |"
        )
    return "\n".join(rows)


def _calibration_table(profile: dict) -> str:
    rows = [
        "| link (ranks) | boundary | latency us | bandwidth | clock offset us | samples "
        "(bytes: fastest one-way ms) |",
        "|---|---|---|---|---|---|",
    ]
    for c in profile["calibration"]:
        samples = ", ".join(f"{s['bytes']:,}: {s['one_way_s'] * 1e3:.3f}" for s in c["samples"])
        rows.append(
            f"| {c['sender']} <-> {c['receiver']} | stage {c['sender_stage']} -> "
            f"{c['sender_stage'] + 1} | {c['latency_s'] * 1e6:.0f} | "
            f"{_rate(c['bandwidth_Bps'])} | {c['clock_offset_s'] * 1e6:.0f} ({c['clock']}) | "
            f"{samples} |"
        )
    return "\n".join(rows)


def _volume_tables(profile: dict) -> str:
    v = profile["volumes"]
    r = v["run"]
    out = [
        f"This run (P = {r['P']}, V = 1, {r['blocks']} blocks, N_p = {r['N_p']:g} per stage): "
        f"paper formula {r['naive_d_per_token']:g} d per token (naive = caching when V = 1); "
        f"the contract sends {v['contract_d_per_token']} d per token "
        f"({v['contract_bytes_per_token']:,} bytes per token, forward). The contract also "
        "carries the embedding b_0 and, inside a block, the partial block, which the paper's "
        "count of completed blocks leaves out.",
        "",
        "| P | V | N | chunks C | N_p | naive (d / token) | caching (d / token) | naive bytes "
        "/ token | caching bytes / token | caching / naive |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in [r | {"P": f"{r['P']} (this run)"}] + v["what_if"]:
        out.append(
            f"| {w['P']} | {w['V']} | {w['N']} | {w['chunks']} | {w['N_p']:g} | "
            f"{w['naive_d_per_token']:g} | {w['caching_d_per_token']:g} | "
            f"{w['naive_bytes_per_token']:,.0f} | {w['caching_bytes_per_token']:,.0f} | "
            f"{w['caching_over_naive']:.2f} |"
        )
    return "\n".join(out)


def _modes_table(profile: dict) -> str:
    modes = profile["modes"]
    names = list(modes)
    rows = [
        "| boundary | " + " | ".join(f"{n}: k, bytes" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for i, spec in enumerate(modes[names[0]]):
        cells = [f"{modes[n][i]['num_tensors']}, {modes[n][i]['bytes_forward']:,}" for n in names]
        name = spec.get("label", f"{spec['sender']} -> {spec['receiver']}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _trace_line(rank, tr: dict) -> str:
    verdict = "equal to" if tr["bytes_equal"] else "DIFFERENT from"
    return (
        f"- rank {rank}: `{tr['file']}`, {tr['events']:,} events; "
        f"gloo:send {tr['gloo_send']['bytes']:,} B, gloo:recv {tr['gloo_recv']['bytes']:,} B "
        f"over {tr['steps']} step(s), {verdict} the contract's prediction"
    )


def _boundary_section(profile: dict, run: dict) -> list[str]:
    verdict = "equal" if profile["bytes_equal_contract"] else "DO NOT equal"
    if profile.get("virtual"):
        return virtual.boundary_lines(profile["virtual"], key_table(profile), verdict)
    meta = ", ".join(f"{b:,} B (rank {r})" for r, b in sorted(run["shape_metadata_bytes"].items()))
    return [
        "## Boundaries (per micro-batch; both directions)",
        "",
        key_table(profile),
        "",
        f"Bytes measured on the wire (DeepSpeed's p2p send/recv) {verdict} the activation "
        "contract's prediction (with tensor parallelism: DeepSpeed's slice of it per tensor "
        "rank plus partition metadata). Send/recv times are wall times of the blocking calls "
        "(they include waiting for the peer); the transfer time counts from when both ends were "
        "ready; the model is latency + bytes / bandwidth from the start-up ping-pong. "
        "DeepSpeed's shape metadata, sent once per engine before the first payload and not part "
        f"of the contract, took {meta}.",
        "",
    ]


def _virtual_volumes(profile: dict) -> str:
    v = profile["virtual"]
    lines = list(v["totals_text"]) or ["baseline: no blocks, the formulas do not apply"]
    table = _volume_tables(profile).split("\n")[2:]  # the what-if rows, not the V = 1 run
    return "\n".join([*lines, "", *[ln for ln in table if "(this run)" not in ln]])


def render(profile: dict) -> str:
    c, run = profile["config"], profile["run"]
    traces = profile["traces"]
    trace_lines = [_trace_line(rank, tr) for rank, tr in traces.items() if tr]
    files = profile["files"]
    return "\n".join(
        [
            "# Stage communication profile",
            "",
            f"{c['model']}; pp = {c['pp']}, dp = {c['dp']}, tp = {c['tp']}, partition "
            f"{c['partition']}; micro-batch {c['micro_batch_size']} x seq {c['seq_length']} x "
            f"hidden {c['hidden_size']}, {c['micro_batches_per_step']} micro-batches per step; "
            f"{c['threads_per_rank']} thread(s) per rank.",
            f"{run['warmup_steps']} warm-up, {run['measured_steps']} measured, "
            f"{run['trace_steps']} traced step(s). Step time median {_ms(run['step_s']['median'])}"
            f" ms (p90 {_ms(run['step_s']['p90'])}); {run['tokens_per_s']['median']:,.0f} "
            "tokens/s.",
            "",
            *_boundary_section(profile, run),
            "## Stages (mean per step; per micro-batch: median)",
            "",
            _stage_table(profile),
            "",
            "Idle = step - forward - backward - transfer - other (waiting for a peer, schedule "
            "overhead), next to the schedule's theoretical bubble (for 1F1B (P - 1) / (M + P - 1))"
            ".",
            "",
            "## Bubble: measured vs the schedule's",
            "",
            *virtual.bubble_lines(profile["bubble"]),
            "",
            "Measured: per step, 1 - (forward + backward time of the P ranks of one pipeline) / "
            "(P x the span from the first pass's start to the last pass's end), median over the "
            "measured steps. Theoretical: the same instruction streams run by the schedule "
            "simulator with free communication (pipeline/schedule_sim.py).",
            "",
            "## Link calibration (ping-pong at start-up)",
            "",
            _calibration_table(profile),
            "",
            "## Communication volume (DESIGN.md section 3)",
            "",
            _volume_tables(profile) if not profile.get("virtual") else _virtual_volumes(profile),
            "",
            "## Bytes per boundary: baseline vs Full vs Block AttnRes (same model)",
            "",
            _modes_table(profile),
            "",
            "## Traces",
            "",
            *trace_lines,
            "",
            "## Files",
            "",
            f"![timeline]({files['timeline']})",
            f"![bytes per boundary]({files['boundary_bytes']})",
            f"![compute vs communication]({files['stage_breakdown']})",
            "",
        ]
    )
