"""The profiler's PNG plots (matplotlib, headless Agg backend).

* ``timeline.png``: one row per rank, one measured step, drawn like the pipeline-schedule
  diagrams of the Megatron papers: forward and backward boxes numbered by micro-batch, sends,
  receives split into waiting (hatched) and transfer, the rest of the row idle.
* ``boundary_bytes.png``: bytes per micro-batch at each boundary for baseline, Full and Block
  AttnRes of the same model (from the contract module alone).
* ``stage_breakdown.png``: per stage, forward, backward, transfer, other and idle time per step.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "send_act": "#dd8452",
    "send_grad": "#dd8452",
    "recv_act": "#c44e52",
    "recv_grad": "#c44e52",
    "wait": "#dddddd",
    "other": "#8172b3",
    "idle": "#f5f5f5",
    "transfer": "#c44e52",
    "commit": "#c44e52",
}
OTHER = ("load", "reduce_tied", "reduce_grads", "optimizer")


def plot_timeline(
    timeline: list[dict],
    path: Path,
    step: int | None = None,
    title: str = "Pipeline schedule per rank (1F1B, DeepSpeed)",
) -> Path:
    """One step; with virtual stages (events naming a chunk) later chunks of a rank are paler."""
    steps = sorted({e["step"] for e in timeline})
    step = steps[-1] if step is None else step
    events = [e for e in timeline if e["step"] == step]
    ranks = sorted({(e["stage"], e["rank"]) for e in events})
    t0 = min(e["start"] for e in events)
    t1 = max(e["end"] for e in events)
    scale = 1e3  # milliseconds
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.6 * len(ranks)))
    phase = {}  # (rank, chunk) -> rank-local chunk index
    for _, rank in ranks:
        mine = sorted({e.get("chunk", -1) for e in events if e["rank"] == rank})
        phase.update({(rank, c): i for i, c in enumerate(mine)})
    for row, (_, rank) in enumerate(ranks):
        y = len(ranks) - 1 - row
        ax.broken_barh([(0, (t1 - t0) * scale)], (y - 0.4, 0.8), color=COLORS["idle"])
        for e in (e for e in events if e["rank"] == rank):
            start, end = (e["start"] - t0) * scale, (e["end"] - t0) * scale
            kind = e["kind"]
            color = COLORS["other"] if kind in OTHER else COLORS.get(kind, "#999999")
            if "ready" in e:  # waiting for the peer, then the transfer itself
                ready = (e["ready"] - t0) * scale
                ax.broken_barh(
                    [(start, ready - start)],
                    (y - 0.4, 0.8),
                    facecolor=COLORS["wait"],
                    hatch="///",
                    edgecolor="#999999",
                    linewidth=0.3,
                )
                start = ready
            height = 0.8 if kind in ("forward", "backward") else 0.4
            chunk = e.get("chunk", -1)
            alpha = 1.0 - 0.3 * phase.get((rank, chunk), 0) if chunk >= 0 else 1.0
            ax.broken_barh(
                [(start, max(end - start, 1e-3))],
                (y - height / 2, height),
                color=color,
                alpha=max(alpha, 0.3),
            )
            if kind in ("forward", "backward") and e["micro_batch"] >= 0:
                label = str(e["micro_batch"]) if chunk < 0 else f"{chunk}.{e['micro_batch']}"
                ax.text(
                    (start + end) / 2,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"stage {s} (rank {r})" for s, r in reversed(ranks)])
    ax.set_xlabel(f"time in step {step} (ms)")
    ax.set_xlim(0, (t1 - t0) * scale)
    ax.legend(
        handles=[
            Patch(color=COLORS["forward"], label="forward (micro-batch)"),
            Patch(color=COLORS["backward"], label="backward (micro-batch)"),
            Patch(color=COLORS["send_act"], label="send"),
            Patch(color=COLORS["recv_act"], label="receive / commit (transfer)"),
            Patch(facecolor=COLORS["wait"], hatch="///", edgecolor="#999999", label="waiting"),
            Patch(color=COLORS["other"], label="load / reduce / optimizer"),
            Patch(facecolor=COLORS["idle"], edgecolor="#cccccc", label="idle"),
        ],
        loc="center left",
        bbox_to_anchor=(1.01, 0.5),
        fontsize=8,
        frameon=False,
    )
    if any(e.get("chunk", -1) >= 0 for e in events):
        title += "; boxes: chunk.micro-batch"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_boundary_bytes(modes: dict[str, list[dict]], path: Path) -> Path:
    first = next(iter(modes.values()))
    labels = [s.get("label", f"stage {s['sender']}->{s['receiver']}") for s in first]
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(labels) + 2), 3.6))
    for i, (mode, specs) in enumerate(modes.items()):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(specs))]
        mib = [s["bytes_forward"] / 2**20 for s in specs]
        bars = ax.bar(xs, mib, width, label=mode)
        for bar, spec in zip(bars, specs, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height(),
                f"k={spec['num_tensors']}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("MiB per micro-batch (each direction)")
    ax.set_title("Bytes per boundary, same model:\nbaseline vs Full vs Block AttnRes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_stage_breakdown(stages: list[dict], path: Path, schedule: str = "1F1B") -> Path:
    parts = [
        ("forward_s", "forward", COLORS["forward"]),
        ("backward_s", "backward", COLORS["backward"]),
        ("transfer_s", "transfer", COLORS["transfer"]),
        ("other_s", "load / reduce / optimizer", COLORS["other"]),
        ("idle_s", "idle", "#bbbbbb"),
    ]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(stages)))
    for row in stages:
        left = 0.0
        y = row["stage"]
        for key, label, color in parts:
            width = row[key] * 1e3
            ax.barh(y, width, left=left, color=color, label=label if y == 0 else None)
            left += width
        ax.text(
            left,
            y,
            f"  idle {row['idle_fraction']:.0%} ({schedule} bubble "
            f"{row.get('bubble_theory', row['bubble_1f1b']):.0%})",
            va="center",
            fontsize=8,
        )
    ax.set_yticks([r["stage"] for r in stages])
    ax.set_yticklabels([f"stage {r['stage']}" for r in stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over measured steps)")
    ax.set_title("Compute vs communication per stage")
    ax.margins(x=0.35)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.4), ncol=5, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
