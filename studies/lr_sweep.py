"""A study's learning-rate sweep: each variant at every rate, then each at its best one.

Small-scale comparisons of AttnRes with its baseline depend on the learning rate (the better
architecture at one rate can trail at another), so a fair table gives each variant its own
best rate: the one with the lowest mean final validation loss over the seeds. The variants
here are ``report.variant_stats`` rows; ``lr`` is read from each run's config.
"""

from __future__ import annotations

from attnres_dist.diagnostics import runs as R


def lr_of(variant: R.Variant) -> float:
    return float(variant.config["optim"]["lr"])


def label_with_lr(variants: list[R.Variant]) -> None:
    """Name every variant ``<architecture>, lr <rate>`` where the study swept the rate."""
    if len({lr_of(v) for v in variants}) > 1:
        for v in variants:
            v.label = f"{R.variant_label(v.config)}, lr {lr_of(v):g}"


def best_per_architecture(variants: list[R.Variant], stats: list[dict]) -> list[dict]:
    """Per architecture (baseline, block S=..., full), in first-seen order, the stats row of
    its best learning rate, with ``lr`` and ``lrs_tried`` added."""
    best: dict[str, dict] = {}
    tried: dict[str, list[float]] = {}
    for variant, row in zip(variants, stats, strict=True):
        arch = R.variant_label(variant.config)
        tried.setdefault(arch, []).append(lr_of(variant))
        if row["valid_mean"] is None:
            continue
        if arch not in best or row["valid_mean"] < best[arch]["valid_mean"]:
            best[arch] = {**row, "label": arch, "lr": lr_of(variant)}
    return [{**row, "lrs_tried": sorted(tried[arch])} for arch, row in best.items()]


def best_lr_table(best: list[dict]) -> list[str]:
    base = next((b for b in best if b["mode"] == "baseline"), None)
    lines = [
        "| variant | best lr (of those tried) | seeds | final validation loss | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for b in best:
        rel = "–" if base is None else f"{b['valid_mean'] - base['valid_mean']:+.4f}"
        tried = ", ".join(f"{lr:g}" for lr in b["lrs_tried"])
        lines.append(
            f"| {b['label']} | {b['lr']:g} ({tried}) | {b['seeds']} | "
            f"{b['valid_mean']:.4f} ± {b['valid_std']:.4f} | {rel} |"
        )
    return lines
