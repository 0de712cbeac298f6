"""A plain-language reading of a study's numbers, sentence by sentence, from ``variant_stats``.

Each sentence states a measured quantity and what it says about one of the study's questions:
does Block or Full AttnRes reach a lower validation loss than the baseline (judged against the
seed-to-seed spread: a difference under two standard errors is called noise), does the
baseline's hidden state grow with depth while Block's partial block restarts at block
boundaries, are AttnRes gradients more uniform over layers, did the depth attention learn to
prefer some sources, and what does AttnRes cost in wall time here.
"""

from __future__ import annotations

import math


def _loss_sentence(v: dict, base: dict) -> str:
    diff = v["valid_mean"] - base["valid_mean"]
    if v["seeds"] < 2 or base["seeds"] < 2:
        verdict = "one seed only, so no spread to judge it against"
        return f"- **{v['label']}** vs baseline: {diff:+.4f} nats ({verdict})."
    se = math.sqrt(v["valid_std"] ** 2 / v["seeds"] + base["valid_std"] ** 2 / base["seeds"])
    z = diff / se if se > 0 else math.copysign(math.inf, diff) if diff else 0.0
    if z <= -2:
        verdict = f"**better** than the baseline ({abs(z):.1f} standard errors)"
    elif z >= 2:
        verdict = f"**worse** than the baseline ({z:.1f} standard errors)"
    else:
        verdict = f"within seed noise ({abs(z):.1f} standard errors; 2 needed to call it)"
    return (
        f"- **{v['label']}**: validation loss {v['valid_mean']:.4f} ± {v['valid_std']:.4f} vs "
        f"baseline {base['valid_mean']:.4f} ± {base['valid_std']:.4f}, a difference of "
        f"{diff:+.4f} nats: {verdict}."
    )


def _growth_sentences(stats: list[dict], base: dict | None) -> list[str]:
    out = []
    if base and base.get("in_growth"):
        g = base["in_growth"]
        trend = "grows" if g > 1.5 else "stays roughly flat" if g > 0.67 else "shrinks"
        out.append(
            f"- Hidden-state magnitude: the baseline's residual stream {trend} with depth (its "
            f"RMS at the last sublayer is {g:.1f}x that at the first; sublayer outputs "
            f"{base['out_growth']:.1f}x)."
        )
    for s in stats:
        if s["mode"] == "block" and s.get("state_drops"):
            drops, n = s["state_drops"]
            out.append(
                f"- {s['label']}: the running partial block's RMS falls at {drops} of {n} block "
                f"boundaries ({'a reset at' if drops == n else 'not at'} every boundary); what "
                f"its sublayers read grows {s['in_growth']:.1f}x from first to last sublayer "
                f"(baseline {base['in_growth']:.1f}x)."
                if base and base.get("in_growth")
                else f"- {s['label']}: the partial block's RMS falls at {drops} of {n} boundaries."
            )
        elif s["mode"] == "full" and s.get("in_growth"):
            out.append(
                f"- {s['label']}: what its sublayers read grows {s['in_growth']:.1f}x from first "
                "to last sublayer (every sublayer closes its own block, so there is no partial "
                "sum to reset)."
            )
    return out


def _gradient_sentences(stats: list[dict], base: dict | None) -> list[str]:
    if not base or base.get("grad_cv") is None:
        return []
    out = []
    for s in stats:
        if s["mode"] == "baseline" or s.get("grad_cv") is None:
            continue
        more = "more" if s["grad_cv"] < base["grad_cv"] else "less"
        out.append(
            f"- Gradients: {s['label']} spreads its per-layer gradient norms {more} uniformly "
            f"than the baseline (coefficient of variation {s['grad_cv']:.2f} vs "
            f"{base['grad_cv']:.2f}; largest / smallest {s['grad_max_min']:.1f} vs "
            f"{base['grad_max_min']:.1f})."
        )
    return out


def _routing_sentences(stats: list[dict]) -> list[str]:
    out = []
    for s in stats:
        h = s.get("entropy_norm")
        if h is None:
            continue
        shape = (
            "close to uniform: the learned queries barely prefer any source"
            if h > 0.95
            else "clearly non-uniform: sublayers learned to prefer some sources"
        )
        out.append(
            f"- Depth attention, {s['label']}: mean entropy {h:.2f} of the uniform maximum, "
            f"largest weight {s['max_weight']:.2f} on average; {shape}."
        )
    return out


def _cost_sentences(stats: list[dict], base: dict | None) -> list[str]:
    out = []
    if base and base.get("wall_mean"):
        for s in stats:
            if s["mode"] != "baseline" and s.get("wall_mean"):
                rel = s["wall_mean"] / base["wall_mean"] - 1
                out.append(
                    f"- Cost: {s['label']} took {s['wall_mean']:.0f} s per run against the "
                    f"baseline's {base['wall_mean']:.0f} s ({100 * rel:+.0f}% wall time)."
                )
    timed = [s for s in stats if s.get("instrument_share") is not None]
    if timed:
        k = timed[0]["every_k"]
        share = [100 * s["instrument_share"] for s in timed]
        diff = [100 * s["overhead_measured"] for s in timed]
        out.append(
            f"- Instrumentation: a measured step spent {min(share):.1f}-{max(share):.1f}% of a "
            f"plain step's time inside the instrumentation ({min(share) / k:.2f}-"
            f"{max(share) / k:.2f}% of training time at one measured step in {k}); measured and "
            f"plain step times differed by {min(diff):+.1f}% to {max(diff):+.1f}%."
        )
    return out


SHARED_MACHINE = (
    "- Cost: not read from this study. Its runs shared the machine (with each other or with "
    "other jobs), so their wall times measure that load, not AttnRes; `make bench` measures "
    "what AttnRes costs, side by side in one process."
)


def reading(stats: list[dict], timed: bool = True) -> list[str]:
    """The reading's sentences; ``timed``: the runs' wall times may be compared (False: they
    shared the machine, and the cost sentences give way to ``SHARED_MACHINE``)."""
    base = next((s for s in stats if s["mode"] == "baseline"), None)
    lines = []
    if base and base["valid_mean"] is not None:
        lines += [_loss_sentence(s, base) for s in stats if s is not base and s["valid_mean"]]
    lines += _growth_sentences(stats, base)
    lines += _gradient_sentences(stats, base)
    lines += _routing_sentences(stats)
    lines += _cost_sentences(stats, base) if timed else [SHARED_MACHINE]
    lines += [
        "",
        "Scale matters for all of this: the paper's gains are measured on models of 100M+ "
        "parameters trained on billions of tokens; a study that fits an hour on two CPU cores "
        "can show the mechanisms (magnitudes, gradients, routing), while a loss difference "
        "here, either way, says little about large scale.",
    ]
    return lines
