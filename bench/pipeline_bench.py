"""Pipeline benchmark: wire bytes vs the contract, packed vs tuple payload, Block vs baseline,
old path vs new, peak memory per stage.

One torchrun job (2 ranks, pp = 2, the tiny config by default) builds five pipeline engines
side by side and runs their training steps interleaved, rotating the order every repetition
and starting each step after a barrier, so that machine noise hits all of them alike:

* ``block_packed``: Block AttnRes, the payload packed into one ``[k, s, b, h]`` tensor;
* ``block_tuple``:  the same model sending the ``k`` tensors as a tuple (DeepSpeed then runs
  one backward traversal per element, DESIGN.md section 3; ``bench/tuple_payload.py`` builds
  that variant, the product sends packed payloads only);
* ``baseline``:     the standard residual model (``k = 1``);
* ``block_old``, ``baseline_old``: the first and the third on the old path (the lean
  depth-attention op, Megatron's core attention, torch's RMSNorm;
  ``model_bench.path_overrides``), where the others take the new one (the defaults).

After the timed steps, one more step per variant measures each stage's peak tensor memory
(``bench.peak_memory``).

A step's time is the slowest rank's. Schedule timers (``attnres_dist.profile.schedule``) also
give each stage's forward and backward time per micro-batch: a tuple payload's extra backward
traversals land on the sending stage, which the step time hides whenever the other stage is
the bottleneck. The wire tap (``attnres_dist.profile.wire``) records every
tensor DeepSpeed's p2p layer sends or receives; per boundary and direction the bytes per
micro-batch must EQUAL ``boundary_specs``. ``run(out_dir)`` writes ``out_dir/pipeline.json``.

Usage: ``python -m bench.pipeline_bench --out DIR``
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from pathlib import Path

from bench import launch_job as job
from bench import tuple_payload
from bench.paired import median_ratio, paired_interval, paired_ratio

# Repetitions: the per-repetition ratio of Block to baseline varies by 5-10% on a shared
# 2-core host (two ranks, one thread each), and 30 left a 96% interval about 12% wide; 60
# narrow it by about 30% (1 / sqrt 2).
REPS = 60

VARIANTS = {  # name: (residual mode, payload, path)
    "block_packed": ("block", "packed", "new"),
    "block_tuple": ("block", "tuple", "new"),
    "baseline": ("baseline", "packed", "new"),
    "block_old": ("block", "packed", "old"),
    "baseline_old": ("baseline", "packed", "old"),
}


def run(
    out_dir: str | Path,
    config: str | Path = job.TINY_CONFIG,
    overrides: tuple[str, ...] = (),
    reps: int = REPS,
    warmup: int = 2,
    old_impl: str = "lean",
    new_impl: str | None = None,
) -> dict:
    """Launch the benchmark job, write ``out_dir/pipeline.json`` and return its content."""
    args = ["--old-impl", old_impl, *([] if new_impl is None else ["--new-impl", new_impl])]
    raw = job.bench_job("bench.pipeline_bench", out_dir, config, reps, warmup, [*args, *overrides])
    steps = {name: v["step_s"]["samples"] for name, v in raw["variants"].items()}
    pairs = {  # ratio name: (numerator, denominator) variants
        "step_time_packed_over_tuple": ("block_packed", "block_tuple"),
        "step_time_block_over_baseline": ("block_packed", "baseline"),
        "step_time_block_over_baseline_old": ("block_old", "baseline_old"),
        "step_time_block_new_over_old": ("block_packed", "block_old"),
    }
    slowest = _bottleneck_stage(raw, "baseline")
    result = raw | {
        "ratios_of_medians": {k: median_ratio(steps[a], steps[b]) for k, (a, b) in pairs.items()},
        # how far the pp = 2 step ratio can be trusted (None with too few repetitions), and
        # the same comparison without the waits: the slowest stage's compute per micro-batch
        "step_time_block_over_baseline_interval": paired_interval(
            steps["block_packed"], steps["baseline"]
        ),
        "bottleneck_stage": slowest,
        "ratios": {
            # step times paired per repetition (bench.paired)
            **{k: paired_ratio(steps[a], steps[b]) for k, (a, b) in pairs.items()},
            **{
                f"stage{stage}_peak_memory_block_new_over_old": new / old
                for stage, (new, old) in enumerate(
                    zip(_peaks(raw, "block_packed"), _peaks(raw, "block_old"), strict=True)
                )
            },
            "stage0_backward_packed_over_tuple": _stage_ms(raw, "block_packed", 0, "backward")
            / _stage_ms(raw, "block_tuple", 0, "backward"),
            "bottleneck_stage_compute_block_over_baseline": _compute_per_micro_batch(
                raw, "block_packed", slowest
            )
            / _compute_per_micro_batch(raw, "baseline", slowest),
        },
        # per stage and micro-batch: the compute Block adds and the C kernels' time it adds
        "block_extra_ms": [
            {
                "stage": stage,
                "compute": _compute_per_micro_batch(raw, "block_packed", stage)
                - _compute_per_micro_batch(raw, "baseline", stage),
                "kernels": _stage_ms(raw, "block_packed", stage, "kernel")
                - _stage_ms(raw, "baseline", stage, "kernel"),
            }
            for stage in sorted(r["stage"] for r in raw["variants"]["baseline"]["stages"])
        ],
        "wire_bytes_equal_prediction": all(
            row["equal"] for v in raw["variants"].values() for row in v["wire"]
        ),
    }
    job.write_result(out_dir, "pipeline.json", result)
    return result


def _peaks(raw: dict, variant: str) -> list[int]:
    """Peak bytes per stage, in stage order."""
    rows = sorted(raw["variants"][variant]["memory"], key=lambda r: r["stage"])
    return [r["peak_bytes"] for r in rows]


def _compute_per_micro_batch(raw: dict, variant: str, stage: int) -> float:
    """A stage's forward + backward milliseconds per micro-batch (medians)."""
    return sum(_stage_ms(raw, variant, stage, kind) for kind in ("forward", "backward"))


def _bottleneck_stage(raw: dict, variant: str) -> int:
    """The stage with the most compute per micro-batch: in the steady state of the schedule
    the others wait for it, so it sets the step."""
    stages = sorted(r["stage"] for r in raw["variants"][variant]["stages"])
    return max(stages, key=lambda stage: _compute_per_micro_batch(raw, variant, stage))


def _stage_ms(raw: dict, variant: str, stage: int, kind: str) -> float:
    rows = [r for r in raw["variants"][variant]["stages"] if r["stage"] == stage]
    return rows[0][f"{kind}_ms"]


def format_table(result: dict) -> str:
    rows = [
        "| variant | step ms median | p90 | boundary | direction | predicted B | wire B | "
        "wire messages | equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        for row in v["wire"]:
            rows.append(
                f"| {name} | {v['step_s']['median'] * 1e3:.1f} | {v['step_s']['p90'] * 1e3:.1f} "
                f"| {row['boundary']} | {row['direction']} | {row['predicted']:,} | "
                f"{', '.join(f'{b:,}' for b in row['measured'])} | {row['messages']} | "
                f"{'yes' if row['equal'] else 'NO'} |"
            )
    return "\n".join(rows)


# -- the job (every rank) ----------------------------------------------------------------------


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from attnres_dist.pipeline.contract import boundary_specs_for_config
    from attnres_dist.profile.schedule import ScheduleTimer
    from attnres_dist.profile.wire import WireTap
    from attnres_dist.train.trainer import Trainer
    from bench.kernel_time import kernel_clock
    from bench.model_bench import path_overrides
    from bench.peak_memory import peak_bytes

    trainers, specs = {}, {}
    for name, (mode, payload, path) in VARIANTS.items():
        cfg = job.variant_config(
            args,
            name,
            *path_overrides(path, args.old_impl, args.new_impl),
            f"model.attnres.mode={mode}",
            "parallel.pp=2",
            "parallel.dp=1",
            "parallel.tp=1",
        )
        with tuple_payload.building(payload):
            trainers[name] = Trainer(cfg)
        specs[name] = boundary_specs_for_config(
            cfg, trainers[name].builder.vocab_size, trainers[name].runtime.activation_dtype
        )
    rank = dist.get_rank()
    names = list(VARIANTS)
    times = {name: [] for name in names}
    kernel_s = {name: [] for name in names}  # seconds per step inside the C kernels
    step_variant = {}
    counter = 0
    engines = [t.engine.engine for t in trainers.values()]
    with contextlib.ExitStack() as stack:
        tap = stack.enter_context(WireTap(engines, rank))
        # per-stage compute times show where a payload format costs, even when the other
        # stage is the bottleneck and the step time hides it
        timers = {
            n: stack.enter_context(ScheduleTimer(t.engine.engine, rank))
            for n, t in trainers.items()
        }
        for rep, name in job.rotating_steps(names, args.warmup, args.reps):
            micro = trainers[name].micro_batches(rep)  # the same data for every variant
            tap.begin_step(counter)
            step_variant[counter] = name
            timers[name].enabled = rep >= args.warmup
            step = functools.partial(trainers[name].engine.train_step, micro)
            with kernel_clock() as clock:
                elapsed = job.timed_step(functools.partial(timers[name].run_step, counter, step))
            counter += 1
            if rep >= args.warmup:
                times[name].append(elapsed)
                kernel_s[name].append(sum(clock.values()))
    memory = {}
    for name in names:  # untimed: the profiler's allocation records slow the step down
        micro = trainers[name].micro_batches(args.warmup + args.reps)
        dist.barrier()
        engine = trainers[name].engine
        device = "cuda" if torch.cuda.is_available() else "cpu"
        peak, method = peak_bytes(lambda e=engine, m=micro: e.train_step(m), device)
        memory[name] = {"stage": rank, "peak_bytes": peak, "method": method}
    transfers = [t.to_dict() | {"boundary": t.boundary} for t in tap.transfers]
    compute = {
        n: _compute_ms(timer.events)
        | {
            "memory": memory[n],
            # the C kernels' time per micro-batch (depth mixing and norms), beside the
            # stage's forward + backward: how much of Block's extra compute they are
            "kernel_ms": statistics.median(kernel_s[n]) * 1e3 / engines[i].micro_batches,
        }
        for i, (n, timer) in enumerate(timers.items())
    }
    gathered = job.gather_to_first((transfers, compute))
    out = None
    if rank == 0:
        every = [t for part, _ in gathered for t in part]
        out = {"variants": {}, "config": job.job_config(args)}
        for name in names:
            mine = [t for t in every if step_variant[t["step"]] == name]
            out["variants"][name] = {
                "model": trainers[name].builder.plan.describe(),
                "payload": VARIANTS[name][1],
                "step_s": job.quantiles(times[name]),
                "wire": _wire_rows(specs[name], mine),
                "stages": [c[name] for _, c in gathered],  # per rank = per stage (pp = 2)
                "memory": [c[name]["memory"] for _, c in gathered],
                "path": VARIANTS[name][2],
            }
    job.finish_worker(args, out)


def _compute_ms(events) -> dict:
    """Median forward and backward milliseconds per micro-batch on this rank."""
    out = {"stage": events[0].stage if events else None}
    for kind in ("forward", "backward"):
        durations = [1e3 * (e.end - e.start) for e in events if e.kind == kind]
        out[f"{kind}_ms"] = statistics.median(durations) if durations else None
    return out


def _wire_rows(specs, transfers: list[dict]) -> list[dict]:
    rows = []
    for spec in specs:
        for direction in ("forward", "backward"):
            predicted = spec.bytes_forward if direction == "forward" else spec.bytes_backward
            mine = [t for t in transfers if tuple(t["boundary"]) == (spec.sender, spec.receiver)]
            mine = [t for t in mine if t["direction"] == direction]
            measured = sorted({t["nbytes"] for t in mine})
            rows.append(
                {
                    "boundary": f"{spec.sender} -> {spec.receiver}",
                    "direction": direction,
                    "k": spec.num_tensors,
                    "predicted": predicted,
                    "measured": measured,
                    "messages": sorted({len(t["shapes"]) for t in mine}),
                    "transfers": len(mine),
                    "equal": measured == [predicted],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = job.parser(__doc__, reps=REPS)
    parser.add_argument("--old-impl", default="lean")
    parser.add_argument("--new-impl", default=None)
    job.main(
        parser,
        argv,
        _worker,
        run,
        format_table,
        own_options=("old_impl", "new_impl"),
    )


if __name__ == "__main__":
    main()
