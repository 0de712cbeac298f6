"""PNG figures of one or more variants (see ``runs``), in the paper's forms where it has one.

* ``losses.png``: training and validation loss against step (mean over seeds, ± std band);
* ``depth_attention_<variant>.png``: mean depth-attention weight per (layer, source), pre-attention
  and pre-MLP side by side (paper Fig. 8), the final aggregation as the MLP panel's last row;
* ``magnitudes.png``: RMS of each sublayer's output, of its input, and of the running state by
  depth (paper Fig. 5 b), block boundaries marked for the first Block variant;
* ``gradients.png``: gradient norm per transformer layer and per sublayer (paper Fig. 5 c);
* ``routing.png``: normalised entropy and largest weight per sublayer (AttnRes variants).

Every function returns the path it wrote, or None when no variant has the data it needs.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from attnres_dist.config.block_plan import BlockPlan  # noqa: E402
from attnres_dist.diagnostics import runs as R  # noqa: E402

COLORS = plt.get_cmap("tab10").colors


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def _color(i: int):
    return COLORS[i % len(COLORS)]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_losses(variants: list[R.Variant], out: Path) -> Path | None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    drawn = False
    for ax, kind, title in zip(
        axes, ("train", "valid"), ("training loss", "validation loss"), strict=True
    ):
        for i, v in enumerate(variants):
            steps, mean, std = v.mean_curve(kind)
            if not len(steps):
                continue
            drawn = True
            seeds = f" ({len(v.runs)} seeds)" if len(v.runs) > 1 else ""
            marker = "o" if kind == "valid" else None
            ax.plot(steps, mean, color=_color(i), marker=marker, ms=3, label=v.label + seeds)
            if len(v.runs) > 1:
                ax.fill_between(steps, mean - std, mean + std, color=_color(i), alpha=0.2)
        ax.set(title=title, xlabel="step", ylabel="loss (nats / token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if not drawn:
        plt.close(fig)
        return None
    return _save(fig, out / "losses.png")


def plot_depth_attention(variant: R.Variant, out: Path) -> Path | None:
    runs = [r for r in variant.runs if r.measures]
    if variant.mode == "baseline" or not runs:
        return None
    panels = []
    for kind in ("attn", "mlp"):
        mats = [R.attention_matrix(r, kind) for r in runs]
        labels = mats[0][1]
        matrix = R.nanmean_rows([m for m, _ in mats])
        panels.append((kind, matrix, labels))
    width = max(m.shape[1] for _, m, _ in panels)
    annotate = width * len(panels[1][2]) <= 200
    fig, axes = plt.subplots(1, 2, figsize=(5 + 0.45 * width, 1.5 + 0.38 * len(panels[1][2])))
    for ax, (kind, matrix, labels) in zip(axes, panels, strict=True):
        image = ax.imshow(
            np.ma.masked_invalid(matrix), cmap="viridis", vmin=0, vmax=1, aspect="auto"
        )
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xticks(range(matrix.shape[1]))
        ax.set(xlabel="source (0 = embedding; block / sublayer output)", ylabel="layer")
        ax.set_title("pre-attention" if kind == "attn" else "pre-MLP (+ final aggregation)")
        if annotate:
            for (row, col), value in np.ndenumerate(matrix):
                if np.isfinite(value):
                    colour = "black" if value > 0.6 else "white"
                    ax.text(
                        col, row, f"{value:.2f}", ha="center", va="center", fontsize=6, color=colour
                    )
        _outline_partials(ax, variant, kind)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    partial = " (red outline: the partial block)" if variant.mode == "block" else ""
    fig.suptitle(f"depth attention, {variant.label}: mean weight per source{partial}")
    return _save(fig, out / f"depth_attention_{slug(variant.label)}.png")


def _outline_partials(ax, variant: R.Variant, kind: str) -> None:
    """Outline the cell of each row's partial block (the block plan says where it is)."""
    m = variant.config["model"]
    plan = BlockPlan(m["num_layers"], m["attnres"]["mode"], m["attnres"]["block_size"])
    for layer in range(plan.num_layers):
        sublayer = 2 * layer + (1 if kind == "attn" else 2)
        completed, partial = plan.state_after(sublayer - 1)
        if partial:
            cell = Rectangle((completed - 0.5, layer - 0.5), 1, 1, fill=False, ec="red", lw=1.2)
            ax.add_patch(cell)


def _block_boundaries(ax, variants: list[R.Variant], per_layer: bool = False) -> None:
    for v in variants:
        if v.mode == "block":
            size = v.config["model"]["attnres"]["block_size"]
            L = 2 * v.config["model"]["num_layers"]
            for end in range(size, L, size):
                ax.axvline(
                    (end / 2 - 0.5) if per_layer else end + 0.5, color="gray", ls=":", lw=0.8
                )
            return


def plot_magnitudes(variants: list[R.Variant], out: Path) -> Path | None:
    keys = (
        ("out_rms", "output RMS of sublayer l (v_l)"),
        ("in_rms", "input RMS of sublayer l (mix x_l; baseline h_l)"),
        ("state_rms", "state RMS after l (partial block; baseline h)"),
    )
    with_data = [(i, v) for i, v in enumerate(variants) if any(r.measures for r in v.runs)]
    if not with_data:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for i, v in with_data:
            profile = v.mean_profile(R.sublayer_profile, key)
            ax.plot(
                np.arange(1, len(profile) + 1), profile, color=_color(i), marker=".", label=v.label
            )
        _block_boundaries(ax, [v for _, v in with_data])
        ax.set(title=title, xlabel="sublayer l", yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return _save(fig, out / "magnitudes.png")


def plot_gradients(variants: list[R.Variant], out: Path) -> Path | None:
    with_data = [(i, v) for i, v in enumerate(variants) if any(r.measures for r in v.runs)]
    if not with_data:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, xlabel in zip(axes, ("layers", "sublayers"), ("layer", "sublayer"), strict=True):
        for i, v in with_data:
            profile = v.mean_profile(R.grad_profile, key)
            start = 0 if key == "layers" else 1
            ax.plot(
                np.arange(start, start + len(profile)),
                profile,
                color=_color(i),
                marker=".",
                label=v.label,
            )
        _block_boundaries(ax, [v for _, v in with_data], per_layer=key == "layers")
        ax.set(title=f"gradient norm per {xlabel}", xlabel=xlabel, yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return _save(fig, out / "gradients.png")


def plot_routing(variants: list[R.Variant], out: Path) -> Path | None:
    attnres = [
        (i, v)
        for i, v in enumerate(variants)
        if v.mode != "baseline" and any(r.measures for r in v.runs)
    ]
    if not attnres:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stat, title in zip(
        axes,
        ("entropy", "max"),
        ("entropy / log(n)  (1 = uniform)", "largest weight (mean over tokens)"),
        strict=True,
    ):
        for i, v in attnres:
            profile = v.mean_profile(R.weight_stat_profile, stat)
            ax.plot(
                np.arange(1, len(profile) + 1), profile, color=_color(i), marker=".", label=v.label
            )
        ax.set(title=title, xlabel="sublayer l", ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "routing.png")


def render_all(variants: list[R.Variant], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_losses(variants, out)]
    paths += [plot_depth_attention(v, out) for v in variants]
    paths += [
        plot_magnitudes(variants, out),
        plot_gradients(variants, out),
        plot_routing(variants, out),
    ]
    return [p for p in paths if p is not None]
