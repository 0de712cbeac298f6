"""Precision benchmark: memory per rank and step time, fp32 vs DeepSpeed's bf16 engine vs ZeRO-1.

One torchrun job (2 ranks, dp = 2, pp = 1, the tiny config by default) builds three DeepSpeed
engines side by side and runs their training steps interleaved (rotating order, a barrier
before each step, the slowest rank's time), so machine noise hits all three alike:

* ``fp32``:      fp32 parameters, ZeRO-0 (the project's count-once clip);
* ``bf16``:      DeepSpeed's bf16 engine (bf16 parameters and payloads; fp32 master weights,
  gradient accumulation and AdamW state in its BF16_Optimizer, sharded over dp);
* ``zero1``:     fp32 with ZeRO-1 (fp32 master copy and AdamW state sharded over dp).

Memory per rank: the bytes of every distinct tensor storage an engine holds for its model and
optimizer (parameters, gradients, DeepSpeed's flat buffers and master partitions, AdamW
state) at the optimizer step, when all gradients are accumulated, found by walking the
engine's module, its optimizer wrapper and the wrapped optimizer. That is the part of a rank's
memory ZeRO-1 changes; bf16 also halves activations and payloads, which this does not count.
On a GPU, the CUDA allocator's peak during each variant's steps is reported too.
``run(out_dir)`` writes ``out_dir/precision.json``.

Usage: ``python -m bench.precision_bench --out DIR [--reps N]``
"""

from __future__ import annotations

import time
from pathlib import Path

from bench import launch_job as job

VARIANTS = {
    "fp32": ("runtime.dtype=fp32", "parallel.zero_stage=0"),
    "bf16": ("runtime.dtype=bf16", "parallel.zero_stage=1"),
    "zero1": ("runtime.dtype=fp32", "parallel.zero_stage=1"),
}


def run(
    out_dir: str | Path,
    config: str | Path = job.TINY_CONFIG,
    overrides: tuple[str, ...] = (),
    reps: int = 10,
    warmup: int = 2,
) -> dict:
    """Launch the benchmark job, write ``out_dir/precision.json`` and return its content."""
    raw = job.bench_job("bench.precision_bench", out_dir, config, reps, warmup, overrides)
    v = raw["variants"]
    step = {name: x["step_s"]["median"] for name, x in v.items()}
    state = {name: max(x["state_bytes_per_rank"]) for name, x in v.items()}
    result = raw | {
        "ratios": {
            "state_bytes_bf16_over_fp32": state["bf16"] / state["fp32"],
            "state_bytes_zero1_over_fp32": state["zero1"] / state["fp32"],
            "step_time_bf16_over_fp32": step["bf16"] / step["fp32"],
            "step_time_zero1_over_fp32": step["zero1"] / step["fp32"],
        }
    }
    job.write_result(out_dir, "precision.json", result)
    return result


def format_table(result: dict) -> str:
    rows = [
        "| variant | model + optimizer state per rank (bytes) | CUDA peak per rank | "
        "step ms median | p90 |",
        "|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        peak = v.get("cuda_peak_bytes_per_rank")
        rows.append(
            f"| {name} | {', '.join(f'{b:,}' for b in v['state_bytes_per_rank'])} | "
            f"{', '.join(f'{b:,}' for b in peak) if peak else 'n/a (CPU)'} | "
            f"{v['step_s']['median'] * 1e3:.1f} | {v['step_s']['p90'] * 1e3:.1f} |"
        )
    return "\n".join(rows)


# -- the job (every rank) ----------------------------------------------------------------------


def state_bytes(engine) -> int:
    """Bytes of the distinct tensor storages an engine holds for model and optimizer state."""
    import torch

    seen: dict[int, int] = {}

    def add(obj, depth: int = 0) -> None:
        if torch.is_tensor(obj):
            for t in (obj, getattr(obj, "grad", None)):
                if t is not None and t.device.type != "meta":
                    storage = t.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
        elif depth < 3 and isinstance(obj, (list, tuple)):
            for item in obj:
                add(item, depth + 1)
        elif depth < 3 and isinstance(obj, dict):
            for item in obj.values():
                add(item, depth + 1)

    ds = engine.engine
    for p in ds.module.parameters():
        add(p)
    wrapper = ds.optimizer
    for value in vars(wrapper).values():
        if torch.is_tensor(value) and value.dim() == 0:
            continue  # a scalar it keeps for logging (the last clip norm), not state
        add(value)
    basic = getattr(wrapper, "optimizer", wrapper)
    for group in basic.param_groups:
        add(group["params"])
    for state in basic.state.values():
        add(state)
    return sum(seen.values())


def _worker(args) -> None:
    import torch
    import torch.distributed as dist

    from attnres_dist.train.trainer import Trainer

    trainers = {}
    for name, extra in VARIANTS.items():
        layout = ("parallel.pp=1", "parallel.dp=2", "parallel.tp=1")
        trainers[name] = Trainer(job.variant_config(args, name, *layout, *extra))
    names = list(VARIANTS)
    times = {name: [] for name in names}
    # model + optimizer state at its largest: at the optimizer step, gradients all accumulated
    held = {name: 0 for name in names}
    for name in names:

        def record(optimizer, hook_args, hook_kwargs, name=name):
            held[name] = max(held[name], state_bytes(trainers[name].engine))

        trainers[name].engine.optimizer.register_step_pre_hook(record)
    peaks = {name: 0 for name in names}
    cuda = torch.cuda.is_available()
    for rep, name in job.rotating_steps(names, args.warmup, args.reps):
        micro = trainers[name].micro_batches(rep)  # the same data for every variant
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainers[name].engine.train_step(micro)
        if cuda:
            torch.cuda.synchronize()
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
        elapsed = job.slowest_rank_seconds(time.perf_counter() - start)
        if rep >= args.warmup:
            times[name].append(elapsed)
    gathered = job.gather_to_first({name: (held[name], peaks[name]) for name in names})
    out = None
    if dist.get_rank() == 0:
        out = {
            "variants": {},
            "config": job.job_config(
                args, layout="pp=1 x dp=2 x tp=1", device="cuda" if cuda else "cpu"
            ),
        }
        for name in names:
            params = list(trainers[name].engine.engine.module.parameters())
            out["variants"][name] = {
                "settings": list(VARIANTS[name]),
                "parameters_per_rank": sum(p.numel() for p in params),
                "parameter_tensors_per_rank": len(params),
                "state_bytes_per_rank": [part[name][0] for part in gathered],
                "step_s": job.quantiles(times[name]),
            }
            if cuda:
                out["variants"][name]["cuda_peak_bytes_per_rank"] = [
                    part[name][1] for part in gathered
                ]
    job.finish_worker(args, out)


def main(argv: list[str] | None = None) -> None:
    job.main(job.parser(__doc__, reps=10), argv, _worker, run, format_table)


if __name__ == "__main__":
    main()
