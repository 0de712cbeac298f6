"""Schedule benchmark: 1F1B vs DualPipeV vs interleaved 1F1B, step time and bubble, side by side.

One torchrun job (2 ranks, pp = 2, the tiny config by default) builds one pipeline engine per
schedule (``parallel.schedule`` = 1f1b, dualpipev, interleaved with V = 2) of the same model
and runs their training steps interleaved, rotating the order every repetition and starting
each step after a barrier, so that machine noise hits all of them alike. Per schedule:

* the step time (the slowest rank's), median and p90, and its ratio to 1F1B's;
* the measured bubble per step (``profile.virtual.measured_bubble``: the idle fraction of the
  ranks between the first pass's start and the last pass's end, from the schedule timers)
  next to the schedule's theoretical bubble (the schedule simulator, backward = 2 forward)
  and the simulator's at the measured pass costs;
* the median forward and backward pass per chunk and micro-batch;
* which payload the chunk boundary sent (naive or cached).

``run(out_dir)`` writes ``out_dir/schedules.json``.

Usage: ``python -m bench.schedule_bench --out DIR [--reps N] [overrides...]``
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from bench import launch_job as job

SCHEDULES = {  # name: overrides
    "1f1b": ("parallel.schedule=1f1b",),
    "dualpipev": ("parallel.schedule=dualpipev",),
    "interleaved": ("parallel.schedule=interleaved", "parallel.virtual_stages=2"),
}


def run(
    out_dir: str | Path,
    config: str | Path = job.TINY_CONFIG,
    overrides: tuple[str, ...] = (),
    reps: int = 8,
    warmup: int = 2,
) -> dict:
    """Launch the job, write ``out_dir/schedules.json`` and return its content."""
    raw = job.bench_job("bench.schedule_bench", out_dir, config, reps, warmup, overrides)
    base = raw["schedules"]["1f1b"]["step_s"]["median"]
    raw["ratios"] = {
        f"step_time_{name}_over_1f1b": v["step_s"]["median"] / base
        for name, v in raw["schedules"].items()
        if name != "1f1b"
    }
    job.write_result(out_dir, "schedules.json", raw)
    return raw


def format_table(result: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    rows = [
        "| schedule | step ms median | p90 | step time / 1F1B | bubble measured median | "
        "theoretical | theoretical at measured costs | fwd / bwd ms per pass | payload |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = result["schedules"]["1f1b"]["step_s"]["median"]
    for name, v in result["schedules"].items():
        b = v["bubble"]
        rows.append(
            f"| {name} | {v['step_s']['median'] * 1e3:.1f} | {v['step_s']['p90'] * 1e3:.1f} | "
            f"{v['step_s']['median'] / base:.3f} | {pct(b['measured']['median'])} | "
            f"{pct(b['theoretical'])} | {pct(b['theoretical_at_measured_costs'])} | "
            f"{b['forward_pass_s'] * 1e3:.2f} / {b['backward_pass_s'] * 1e3:.2f} | "
            f"{v['payload']} |"
        )
    return "\n".join(rows)


def _worker(args) -> None:
    import torch.distributed as dist

    from attnres_dist.profile.schedule import ScheduleTimer
    from attnres_dist.profile.virtual import bubble_section, sends_cached
    from attnres_dist.train.trainer import Trainer

    trainers = {}
    for name, extra in SCHEDULES.items():
        layout = ("parallel.pp=2", "parallel.dp=1", "parallel.tp=1")
        trainers[name] = Trainer(job.variant_config(args, name, *extra, *layout))
    rank = dist.get_rank()
    names = list(SCHEDULES)
    times = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        timers = {
            n: stack.enter_context(ScheduleTimer(t.engine.engine, rank))
            for n, t in trainers.items()
        }
        for rep, name in job.rotating_steps(names, args.warmup, args.reps):
            micro = trainers[name].micro_batches(rep)  # the same data for every schedule
            timers[name].enabled = rep >= args.warmup
            step = functools.partial(trainers[name].engine.train_step, micro)
            elapsed = job.timed_step(functools.partial(timers[name].run_step, rep, step))
            if rep >= args.warmup:
                times[name].append(elapsed)
    events = {n: [e.to_dict() for e in timer.events] for n, timer in timers.items()}
    gathered = job.gather_to_first(events)
    out = None
    if rank == 0:
        out = {
            "config": {"path": str(args.config), "overrides": args.overrides, "reps": args.reps},
            "schedules": {},
        }
        for name in names:
            t = trainers[name]
            ranks = [{"rank": r, "events": g[name]} for r, g in enumerate(gathered)]
            cached = name != "1f1b" and sends_cached(t.engine.engine, t.cfg)
            out["schedules"][name] = {
                "micro_batches": t.cfg.grad_accum_steps,
                "step_s": job.quantiles(times[name]),
                "bubble": bubble_section(t.cfg, ranks, t.dims),
                "payload": "1f1b contract" if name == "1f1b" else ("cached" if cached else "naive"),
            }
    job.finish_worker(args, out)


def main(argv: list[str] | None = None) -> None:
    job.main(job.parser(__doc__, reps=8), argv, _worker, run, format_table)


if __name__ == "__main__":
    main()
