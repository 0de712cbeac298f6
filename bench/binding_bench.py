"""Core binding benchmark: a pp = 2 step with each rank on its own cores vs left to the scheduler.

Binding has to happen before the process group starts (its threads inherit the placement), so
one process cannot switch between the two: each placement is a torchrun job of its own (2 ranks,
the tiny config by default) with ``runtime.cpu_binding=cores`` or ``none``, and the jobs
alternate, ``rounds`` of each. Within a job the Block AttnRes and the baseline pipeline engines
run their steps interleaved (rotating order, a barrier before each step). A step's time is the
slowest rank's.

Ratios: unbound / bound step time for each model (the median over rounds of the ratio of the
two adjacent jobs' medians, so that a slow spell of the machine, which lasts longer than a job,
cancels), and Block / baseline under each placement (paired within the jobs).
``run(out_dir)`` writes ``out_dir/pipeline_binding.json``.

Usage: ``python -m bench.binding_bench --out DIR``
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

from bench import launch_job as job
from bench.paired import median_ratio, paired_ratio

MODELS = ("block", "baseline")
PLACEMENTS = ("bound", "unbound")
BINDING = {"bound": "cores", "unbound": "none"}


def run(
    out_dir: str | Path,
    config: str | Path = job.TINY_CONFIG,
    overrides: tuple[str, ...] = (),
    reps: int = 8,
    warmup: int = 2,
    rounds: int = 3,
) -> dict:
    """Launch the alternating jobs, write ``out_dir/pipeline_binding.json`` and return it."""
    jobs = {p: [] for p in PLACEMENTS}
    for r in range(rounds):
        order = PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]
        for placement in order:
            args = ["--binding", BINDING[placement], *overrides]
            jobs[placement].append(
                job.bench_job("bench.binding_bench", out_dir, config, reps, warmup, args)
            )
    samples = {  # variant: every job's step times, and each job's median
        f"{m}_{p}": [raw["steps"][m] for raw in jobs[p]] for m in MODELS for p in PLACEMENTS
    }
    medians = {k: [statistics.median(s) for s in v] for k, v in samples.items()}
    flat = {k: [x for s in v for x in s] for k, v in samples.items()}
    ratios = {
        f"{m}_unbound_over_bound": paired_ratio(medians[f"{m}_unbound"], medians[f"{m}_bound"])
        for m in MODELS
    } | {
        f"block_over_baseline_{p}": paired_ratio(flat[f"block_{p}"], flat[f"baseline_{p}"])
        for p in PLACEMENTS
    }
    result = {
        "variants": {
            k: {"step_s": job.quantiles(v), "job_medians_s": medians[k]} for k, v in flat.items()
        },
        "ratios": ratios,
        "ratios_of_medians": {
            f"{m}_unbound_over_bound": median_ratio(flat[f"{m}_unbound"], flat[f"{m}_bound"])
            for m in MODELS
        },
        "config": jobs["bound"][0]["config"] | {"rounds": rounds},
    }
    job.write_result(out_dir, "pipeline_binding.json", result)
    return result


def format_table(result: dict) -> str:
    rows = ["| variant | step ms median | p90 |", "|---|---|---|"]
    for name, v in result["variants"].items():
        s = v["step_s"]
        rows.append(f"| {name} | {s['median'] * 1e3:.1f} | {s['p90'] * 1e3:.1f} |")
    return "\n".join(rows)


def markdown_rows(result: dict) -> list[str]:
    """The summary's rows (``bench.run``)."""
    r, v = result["ratios"], result["variants"]
    ms = {name: x["step_s"]["median"] * 1e3 for name, x in v.items()}
    share = result["config"]["cores"]
    rows = [
        f"| pipeline step time, unbound / bound ranks, {m} | {r[f'{m}_unbound_over_bound']:.3f} "
        f"| pp = 2: {ms[f'{m}_unbound']:.1f} ms on the scheduler's cores vs "
        f"{ms[f'{m}_bound']:.1f} ms with each rank on its own ({share}) |"
        for m in MODELS
    ]
    rows += [
        f"| pipeline step time, Block AttnRes / baseline, {p} ranks | "
        f"{r[f'block_over_baseline_{p}']:.3f} | pp = 2 |"
        for p in PLACEMENTS
    ]
    return rows


# -- the job (every rank) ----------------------------------------------------------------------


def _worker(args) -> None:
    import os

    import torch.distributed as dist

    from attnres_dist.train.trainer import Trainer

    trainers = {
        m: Trainer(
            job.variant_config(
                args,
                m,
                *args.overrides,
                f"model.attnres.mode={m}",
                "parallel.pp=2",
                "parallel.dp=1",
                "parallel.tp=1",
                f"runtime.cpu_binding={args.binding}",
            )
        )
        for m in MODELS
    }
    times = {m: [] for m in MODELS}
    for rep, m in job.rotating_steps(list(MODELS), args.warmup, args.reps):
        micro = trainers[m].micro_batches(rep)  # the same data for every variant
        elapsed = job.timed_step(functools.partial(trainers[m].engine.train_step, micro))
        if rep >= args.warmup:
            times[m].append(elapsed)
    cores = job.gather_to_first(sorted(os.sched_getaffinity(0)))
    out = None
    if dist.get_rank() == 0:
        out = {
            "steps": times,
            "config": {
                "path": str(args.config),
                "overrides": args.overrides,
                "reps": args.reps,
                "warmup": args.warmup,
                "cores": "; ".join(f"rank {r}: cores {c}" for r, c in enumerate(cores)),
            },
        }
    job.finish_worker(args, out)


def main(argv: list[str] | None = None) -> None:
    parser = job.parser(__doc__, reps=8)
    parser.add_argument("--binding", default="cores", choices=tuple(BINDING.values()))
    parser.add_argument("--rounds", type=int, default=3)
    job.main(parser, argv, _worker, run, format_table, own_options=("rounds",))


if __name__ == "__main__":
    main()
