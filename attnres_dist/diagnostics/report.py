"""``attnres-dist report RUN_DIR [RUN_DIR ...]``: figures and a markdown summary of runs.

Runs are grouped into variants (``runs.group_runs``: same config up to the seed); the report
holds a table per variant (validation loss mean ± std over seeds, wall time, measurement
overhead), one per run, the depth statistics the study reads (hidden-state growth, resets at
block boundaries, gradient uniformity, routing entropy) and the figures of ``plots``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import numpy as np

from attnres_dist.diagnostics import runs as R


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:+.1f}%"


def _ratio(profile: np.ndarray) -> float | None:
    finite = profile[np.isfinite(profile)]
    return float(finite[-1] / finite[0]) if len(finite) >= 2 and finite[0] > 0 else None


def boundary_drops(variant: R.Variant) -> tuple[int, int] | None:
    """(boundaries where the state RMS falls, boundaries) for Block; every sublayer otherwise.

    Block AttnRes restarts its partial block at each boundary, so its state should fall there;
    the baseline's residual stream has no boundaries and is checked between all sublayers.
    """
    state = variant.mean_profile(R.sublayer_profile, "state_rms")
    if not len(state) or not np.isfinite(state).all():
        return None
    if variant.mode == "block":
        size = variant.config["model"]["attnres"]["block_size"]
        ends = list(range(size, len(state), size))  # 1-based sublayers closing a block
    elif variant.mode == "baseline":
        ends = list(range(1, len(state)))
    else:
        return None  # Full: every sublayer is its own block, the state is just v_l
    drops = sum(1 for e in ends if state[e] < state[e - 1])
    return drops, len(ends)


def variant_stats(variant: R.Variant) -> dict:
    """Numbers of one variant that the report and the study's reading use."""
    losses = variant.valid_losses()
    timing = [r.timing for r in variant.runs if r.timing and r.timing.get("instrument_share")]

    def mean_of(rows, key):
        values = [row[key] for row in rows if row.get(key) is not None]
        return float(np.mean(values)) if values else None

    summaries = [r.summary for r in variant.runs if r.summary]
    stats = {
        "label": variant.label,
        "mode": variant.mode,
        "seeds": len(variant.runs),
        "valid_losses": losses,
        "valid_mean": None,
        "valid_std": None,
        "wall_mean": mean_of(summaries, "wall_time_s"),
        "tokens_per_s": mean_of(summaries, "tokens_per_s"),
        "measured_step_s": mean_of(timing, "measured_step_s"),
        "unmeasured_step_s": mean_of(timing, "unmeasured_step_s"),
        "overhead_measured": mean_of(timing, "overhead_per_measured_step"),
        "instrument_share": mean_of(timing, "instrument_share"),
        "every_k": timing[0]["every_k"] if timing else None,
    }
    if losses:
        stats["valid_mean"], stats["valid_std"] = R.mean_std(losses)
    if not any(r.measures for r in variant.runs):
        return stats
    grads = variant.mean_profile(R.grad_profile, "layers")
    grads = grads[np.isfinite(grads)]
    stats.update(
        in_growth=_ratio(variant.mean_profile(R.sublayer_profile, "in_rms")),
        out_growth=_ratio(variant.mean_profile(R.sublayer_profile, "out_rms")),
        state_drops=boundary_drops(variant),
        grad_cv=float(grads.std() / grads.mean()) if len(grads) > 1 else None,
        grad_max_min=float(grads.max() / grads.min())
        if len(grads) > 1 and grads.min() > 0
        else None,
    )
    if variant.mode != "baseline":
        entropy = variant.mean_profile(R.weight_stat_profile, "entropy")
        peak = variant.mean_profile(R.weight_stat_profile, "max")
        stats["entropy_norm"] = float(np.nanmean(entropy)) if np.isfinite(entropy).any() else None
        stats["max_weight"] = float(np.nanmean(peak[1:])) if len(peak) > 1 else None
    return stats


def variant_table(all_stats: list[dict], timed: bool = True) -> list[str]:
    """One row per variant. *vs baseline* is the wall time against the baseline trained at the
    same learning rate (rows' ``lr``, where a study swept it); "–" where the runs' wall times
    may not be compared (``timed`` False: they shared the machine)."""
    lines = [
        "| variant | seeds | final validation loss | wall time (s) | vs baseline | tokens/s "
        "| measured / plain step (s) | instrumentation cost per measured step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in all_stats:
        loss = f"{_fmt(s['valid_mean'], 4)} ± {_fmt(s['valid_std'], 4)}" if s["valid_mean"] else "–"
        rel = None
        baseline = next(
            (b for b in all_stats if b["mode"] == "baseline" and b.get("lr") == s.get("lr")), None
        )
        if timed and baseline and baseline["wall_mean"] and s["wall_mean"]:
            rel = s["wall_mean"] / baseline["wall_mean"] - 1.0
        steps = f"{_fmt(s['measured_step_s'])} / {_fmt(s['unmeasured_step_s'])}"
        over = "–"
        if s["instrument_share"] is not None:
            over = (
                f"{100 * s['instrument_share']:.1f}% inside it "
                f"({100 * s['instrument_share'] / s['every_k']:.2f}% at k={s['every_k']}); "
                f"step times differ by {_pct(s['overhead_measured'])}"
            )
        lines.append(
            f"| {s['label']} | {s['seeds']} | {loss} | {_fmt(s['wall_mean'], 1)} | {_pct(rel)} "
            f"| {_fmt(s['tokens_per_s'], 0)} | {steps} | {over} |"
        )
    return lines


def depth_table(all_stats: list[dict]) -> list[str]:
    lines = [
        "| variant | input RMS last / first | output RMS last / first | state RMS falls at "
        "| grad-norm CV over layers | grad max / min | entropy / log n | largest weight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in all_stats:
        if "in_growth" not in s:
            continue
        drops = s["state_drops"]
        where = "–"
        if drops is not None:
            noun = "block boundaries" if s["mode"] == "block" else "sublayer steps"
            where = f"{drops[0]} / {drops[1]} {noun}"
        lines.append(
            f"| {s['label']} | {_fmt(s['in_growth'], 2)} | {_fmt(s['out_growth'], 2)} | {where} "
            f"| {_fmt(s['grad_cv'], 2)} | {_fmt(s['grad_max_min'], 2)} "
            f"| {_fmt(s.get('entropy_norm'), 2)} | {_fmt(s.get('max_weight'), 2)} |"
        )
    return lines


def run_table(variants: list[R.Variant]) -> list[str]:
    lines = [
        "| run | variant | seed | steps | final train loss | final validation loss "
        "| wall time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        for r in v.runs:
            s = r.summary or {}
            lines.append(
                f"| {r.name} | {v.label} | {r.seed} | {r.steps} "
                f"| {_fmt(s.get('final_train_loss'), 4)} | {_fmt(r.final_valid_loss, 4)} "
                f"| {_fmt(s.get('wall_time_s'), 1)} |"
            )
    return lines


DEPTH_NOTE = (
    "Depth statistics are means over each run's measured steps in the last half of training, "
    "then over seeds. *state* is the running partial block (AttnRes) or the residual stream "
    "(baseline) after each sublayer; *largest weight* excludes sublayer 1 (one source)."
)


def figure_lines(figures: list[Path], relative_to: Path) -> list[str]:
    lines = []
    for path in figures:
        rel = os.path.relpath(path, relative_to)
        lines += [f"![{path.stem}]({rel})", ""]
    return lines


def render(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Write figures and ``report.md`` into ``out``; returns the markdown file's path."""
    out = Path(out)
    variants = R.group_runs([R.load_run(d) for d in run_dirs])
    # matplotlib only when figures are drawn: every ``attnres-dist`` command builds this
    # parser, and most never plot
    from attnres_dist.diagnostics import plots

    figures = plots.render_all(variants, out)
    all_stats = [variant_stats(v) for v in variants]
    lines = ["# Diagnostics report", "", "## Variants", "", *variant_table(all_stats), ""]
    lines += ["## Runs", "", *run_table(variants), ""]
    if any("in_growth" in s for s in all_stats):
        lines += ["## Depth statistics", "", DEPTH_NOTE, "", *depth_table(all_stats), ""]
    lines += ["## Figures", "", *figure_lines(figures, out)]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def add_parser(sub) -> None:
    parser = sub.add_parser("report", help="plots and a markdown summary of one or more runs")
    parser.add_argument("run_dirs", nargs="+", help="run directories (output.run_dir)")
    parser.add_argument(
        "--out", default=None, help="output directory (default: <first run>/report)"
    )
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from attnres_dist.errors import UserError

    for d in args.run_dirs:
        if not (Path(d) / "config.yaml").is_file():
            raise UserError(d, "not a run directory (no config.yaml); pass output.run_dir paths")
    out = args.out or str(Path(args.run_dirs[0]) / "report")
    path = render(args.run_dirs, out)
    print(f"wrote {path} and {len(list(Path(out).glob('*.png')))} figures")
    return 0
