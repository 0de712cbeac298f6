"""MoE benchmark: what AttnRes costs on a mixture-of-experts model, and the all-to-all's share.

One torchrun job (2 ranks, dp = ep = 2: each rank holds half the experts, tokens travel by
the dispatcher's all-to-all; ``configs/moe_tiny.yaml`` by default) builds two trainers side
by side and runs their training steps interleaved (rotating order, a barrier before each
step, the slowest rank's time), so machine noise hits them alike:

* ``moe_baseline``: the MoE model with the plain PreNorm residual;
* ``moe_block``:    the same model with Block AttnRes (the config's block size).

(Both share the process's Megatron groups, so a dense variant, with no expert parallelism,
cannot run beside them.)

During every step each rank also times its calls of the dispatcher's collectives
(``torch.distributed.all_to_all_single``, and ``all_gather_into_tensor`` / ``all_gather``
for the all-gather dispatcher), wrapped from outside for the run: ``dispatch_share`` is that
time over the step time (per rank, median over steps). ``run(out_dir)`` writes
``out_dir/moe.json``.

Usage: ``python -m bench.moe_bench --out DIR [--reps N]``
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

from bench import launch_job as job
from bench.paired import paired_ratio

MOE_CONFIG = job.REPO / "configs" / "moe_tiny.yaml"
LAYOUT = ("parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "parallel.tp=1")
VARIANTS = {
    "moe_baseline": ("model.attnres.mode=baseline", *LAYOUT),
    "moe_block": ("model.attnres.mode=block", *LAYOUT),
}
COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather")


def run(
    out_dir: str | Path,
    config: str | Path = MOE_CONFIG,
    overrides: tuple[str, ...] = (),
    reps: int = 10,
    warmup: int = 2,
) -> dict:
    """Launch the benchmark job, write ``out_dir/moe.json`` and return its content."""
    raw = job.bench_job("bench.moe_bench", out_dir, config, reps, warmup, overrides)
    v = raw["variants"]
    step = {name: x["step_s"]["samples"] for name, x in v.items()}
    result = raw | {
        "ratios": {
            "moe_block_over_moe_baseline": paired_ratio(step["moe_block"], step["moe_baseline"]),
            "dispatch_share_moe_block": v["moe_block"]["dispatch_share"],
            "dispatch_share_moe_baseline": v["moe_baseline"]["dispatch_share"],
        }
    }
    job.write_result(out_dir, "moe.json", result)
    return result


def format_table(result: dict) -> str:
    rows = [
        "| variant | parameters per rank | step ms median | p90 | dispatch collectives ms "
        "per step (median) | their share of the step |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        rows.append(
            f"| {name} | {v['parameters_per_rank']:,} | {v['step_s']['median'] * 1e3:.1f} | "
            f"{v['step_s']['p90'] * 1e3:.1f} | {v['dispatch_s_median'] * 1e3:.2f} | "
            f"{v['dispatch_share']:.3f} |"
        )
    return "\n".join(rows)


def markdown(moe: dict) -> list[str]:
    """The summary's section (``bench/run.py``)."""
    r = moe["ratios"]
    return [
        "",
        "## Mixture of experts at dp = ep = 2",
        "",
        f"`{moe['config']['path']}`, {moe['config']['reps']} repetitions, interleaved; the "
        "dispatcher's collectives timed on each rank inside the step.",
        "",
        format_table(moe),
        "",
        "| ratio | value |",
        "|---|---|",
        f"| MoE Block / MoE baseline step, paired | {r['moe_block_over_moe_baseline']:.3f} |",
        f"| dispatch collectives / step, MoE Block | {r['dispatch_share_moe_block']:.3f} |",
        f"| dispatch collectives / step, MoE baseline | {r['dispatch_share_moe_baseline']:.3f} |",
    ]


# -- the job (every rank) ----------------------------------------------------------------------


@contextlib.contextmanager
def timed_collectives(clock: list[float]):
    """``torch.distributed``'s dispatcher collectives, each call's seconds added to
    ``clock[0]`` (the module attributes Megatron calls through), for the ``with`` block."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - start

        return call

    for name, fn in originals.items():
        setattr(dist, name, timed(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _worker(args) -> None:
    import torch.distributed as dist

    from attnres_dist.train.trainer import Trainer

    trainers = {name: Trainer(job.variant_config(args, name, *s)) for name, s in VARIANTS.items()}
    names = list(VARIANTS)
    times = {name: [] for name in names}
    dispatch = {name: [] for name in names}
    for rep, name in job.rotating_steps(names, args.warmup, args.reps):
        micro = trainers[name].micro_batches(rep)  # the same data for every variant
        clock = [0.0]
        dist.barrier()
        start = time.perf_counter()
        with timed_collectives(clock):
            trainers[name].engine.train_step(micro)
        elapsed = job.slowest_rank_seconds(time.perf_counter() - start)
        if rep >= args.warmup:
            times[name].append(elapsed)
            dispatch[name].append(clock[0])
    gathered = job.gather_to_first(dispatch)
    out = None
    if dist.get_rank() == 0:
        out = {"variants": {}, "config": job.job_config(args)}
        for name in names:
            params = list(trainers[name].engine.engine.module.parameters())
            per_rank = [paired_ratio(r[name], times[name]) for r in gathered]
            out["variants"][name] = {
                "settings": list(VARIANTS[name]),
                "parameters_per_rank": sum(p.numel() for p in params),
                "step_s": job.quantiles(times[name]),
                "dispatch_s_median": statistics.median(x for r in gathered for x in r[name]),
                "dispatch_share": max(per_rank),  # the busiest rank's median share
            }
    job.finish_worker(args, out)


def main(argv: list[str] | None = None) -> None:
    parser = job.parser(__doc__, reps=10)
    parser.set_defaults(config=str(MOE_CONFIG))
    job.main(parser, argv, _worker, run, format_table)


if __name__ == "__main__":
    main()
