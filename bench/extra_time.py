"""What AttnRes's extra step time is made of, as ``make bench`` summary tables.

Both read ``model_bench``'s result (single process, new path):

* :func:`fixed_cost_rows`: the extra time on one short sequence, where the arithmetic is next
  to nothing (per-call cost), beside the extra time at full size;
* :func:`kernel_rows`: the time the steps spent inside the project's C kernels (the depth
  mixing's, and the RMSNorm every model runs), the baseline's beside Block's and Full's, and
  which share of the extra step time the kernels' extra time is.
"""

from __future__ import annotations


def fixed_cost_rows(model: dict) -> list[str]:
    """AttnRes's extra step time on a few tokens beside its extra time at full size."""
    fixed, c = model["fixed_cost"], model["config"]
    tokens = next(iter(fixed.values()))["tokens"]

    def cells(group: dict) -> str:
        ratio = "n/a" if group["ratio"] is None else f"{group['ratio']:.2f}"
        return f"{group['extra_ms_full_size']:.1f} | {group['extra_ms']:.1f} | {ratio}"

    lines = [
        "",
        f"What does not scale with tokens: AttnRes's extra step time (ms, new path, paired "
        f"medians) at {c['batch']} x {c['seq']} tokens and on one {tokens}-token sequence, "
        "where the arithmetic is next to nothing and what remains is per-call cost (Python, "
        "autograd nodes, dispatch, the optimizer's extra tensors) with warm caches. At full "
        "size the same calls run between kernels that leave the caches cold, so the ratio "
        "says how much of the extra time is per-call work, not what removing it would save "
        "(docs/kernels.md, 'Calls').",
        "",
        f"| shape | Block extra, full size | Block extra, {tokens} tokens | ratio | "
        f"Full extra, full size | Full extra, {tokens} tokens | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, group in fixed.items():
        lines.append(f"| {shape} | {cells(group['block'])} | {cells(group['full'])} |")
    return lines


def kernel_rows(model: dict) -> list[str]:
    """Time inside the C kernels per step and its share of AttnRes's extra step time."""
    c = model["config"]
    lines = [
        "",
        f"Where the extra time goes: milliseconds per step inside the project's C kernels "
        f"(new path, {c['batch']} x {c['seq']} tokens, the timed steps themselves; medians): "
        "the baseline's are its RMSNorms, Block's and Full's the depth mixing (phase 1, the "
        "merges with their norms) and the norms outside it. 'Kernels' extra' is the paired "
        "median of the kernel time AttnRes adds, 'share' its quotient with the extra step "
        "time. The rest of the extra time is outside the kernels: per-call work, and the ops "
        "both models run slowed by AttnRes's larger working set (docs/kernels.md, 'Kernel "
        "time against extra time').",
        "",
        "| shape | mode | kernels, baseline | kernels, AttnRes | extra step time | "
        "kernels' extra | share | AttnRes kernels by entry point |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, group in model["step"].items():
        v = group["variants"]
        base = v["baseline_new"]["kernel_s"]["median"] * 1e3
        for mode in ("block", "full"):
            k = v[f"{mode}_new"]["kernel_s"]
            s = group["kernel_share"][mode]
            share = "n/a" if s["share"] is None else f"{s['share']:.2f}"
            parts = ", ".join(f"{n} {t * 1e3:.2f}" for n, t in k["by_kernel"].items())
            lines.append(
                f"| {shape} | {mode} | {base:.2f} | {k['median'] * 1e3:.2f} | "
                f"{s['extra_ms']:.2f} | {s['kernel_extra_ms']:.2f} | {share} | {parts or '-'} |"
            )
    return lines


def pipeline_kernel_rows(pipe: dict) -> list[str]:
    """Rows of the summary's ratio table: per pp = 2 stage, the share of Block's extra compute
    per micro-batch that is extra time inside the C kernels."""
    rows = []
    for extra in pipe["block_extra_ms"]:
        compute, kernels = extra["compute"], extra["kernels"]
        share = f"{kernels / compute:.2f}" if compute > 0 else "n/a"
        rows.append(
            f"| stage {extra['stage']} extra compute per micro-batch in the C kernels, Block "
            f"AttnRes - baseline | {share} | pp = 2, new path: {kernels:+.2f} ms in the kernels "
            f"(depth mixing and norms) of {compute:+.2f} ms of forward + backward |"
        )
    return rows
