"""A multi-process benchmark job: launch it under torchrun, run its steps, collect its JSON.

Benchmarks that measure the pipeline need real ranks. ``torchrun_job`` starts ``python -m
MODULE ARGS`` in ``nproc`` processes on a free rendezvous port (both torchrun and DeepSpeed
default to 29500, which concurrent jobs would fight over) with one intra-op thread per rank
(more oversubscribes the cores: DESIGN.md section 4), and raises with the tail of stderr when
the job fails.

Such a benchmark is one module that is both the launcher and the worker: ``parser`` gives
both sides the same command line, ``bench_job`` starts the worker side and reads back the JSON
its rank 0 wrote, ``main`` dispatches. On the ranks, ``variant_config`` builds each variant's
config, ``rotating_steps`` gives the rotating order of the timed steps (machine noise hits every
variant alike), ``timed_step`` (``slowest_rank_seconds``) a step's time, ``gather_to_first``
the ranks' records and ``finish_worker`` writes the result and closes the process groups.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from attnres_dist.parallel.launch_env import free_port

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny.yaml"


def torchrun_job(
    module: str,
    args: list[str],
    nproc: int,
    timeout: float = 1800,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # the module is a harness module: importable from the repository root, not from the wheel
    full_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    full_env.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "-m",
        module,
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-40:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{tail}")
    return proc


# -- the launching side ------------------------------------------------------------------------


def bench_job(
    module: str,
    out_dir: str | Path,
    config: str | Path,
    reps: int,
    warmup: int,
    extra_args: list[str] | tuple[str, ...] = (),
    nproc: int = 2,
) -> dict:
    """Create ``out_dir``, run MODULE's worker side on ``nproc`` ranks, return its JSON.

    The worker gets ``--worker RAW --config --reps --warmup --run-dir TMP`` and then
    ``extra_args`` (its own options and the config overrides), all in one temporary directory.
    """
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        args = ["--worker", str(raw_path), "--config", str(config), "--reps", str(reps)]
        args += ["--warmup", str(warmup), "--run-dir", tmp, *extra_args]
        torchrun_job(module, args, nproc=nproc)
        return json.loads(raw_path.read_text())


def write_result(out_dir: str | Path, name: str, result: dict) -> None:
    (Path(out_dir) / name).write_text(json.dumps(result, indent=2) + "\n")


def parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """The command line both sides of a benchmark job read (add the module's own options)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=str(TINY_CONFIG))
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    return parser


def main(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    worker: Callable[[argparse.Namespace], None],
    run: Callable[..., dict],
    format_table: Callable[[dict], str],
    own_options: tuple[str, ...] = (),
) -> None:
    """Run the worker side under ``--worker``; otherwise launch and print the table and ratios.

    ``run(out, config, overrides, reps, warmup, *own)`` launches, where ``own`` are the values
    of the module's ``own_options`` (argparse names), in that order.
    """
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    own = [getattr(args, name) for name in own_options]
    result = run(args.out, args.config, tuple(args.overrides), args.reps, args.warmup, *own)
    print(format_table(result))
    print(json.dumps(result["ratios"], indent=2))


# -- the job (every rank) ----------------------------------------------------------------------


def variant_config(args: argparse.Namespace, name: str, *settings: str):
    """Variant ``name``'s config: the job's overrides, then ``settings``, no side outputs."""
    from attnres_dist.config import load_config

    return load_config(
        args.config,
        [
            *args.overrides,
            *settings,
            "output.tensorboard=false",
            "train.progress=false",
            f"output.run_dir={args.run_dir}/{name}",
        ],
    )


def job_config(args: argparse.Namespace, **extra) -> dict:
    """What a job's result records of how it ran: config, overrides, repetitions, threads."""
    import torch

    return {
        "path": str(args.config),
        "overrides": args.overrides,
        "reps": args.reps,
        "warmup": args.warmup,
        "threads_per_rank": torch.get_num_threads(),
        **extra,
    }


def rotating_steps(names: list[str], warmup: int, reps: int) -> Iterator[tuple[int, str]]:
    """``(rep, name)`` per step: every name once a repetition, the order rotating each one."""
    for rep in range(warmup + reps):
        first = rep % len(names)
        for name in names[first:] + names[:first]:
            yield rep, name


def slowest_rank_seconds(seconds: float) -> float:
    """The largest of every rank's ``seconds`` (collective): a step's time is its slowest rank's."""
    import torch
    import torch.distributed as dist

    from attnres_dist.parallel.comm_device import comm_device

    elapsed = torch.tensor(seconds, dtype=torch.float64, device=comm_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def timed_step(step: Callable[[], object]) -> float:
    """Seconds of ``step()`` started after a barrier on every rank, the slowest rank's
    (collective)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    step()
    return slowest_rank_seconds(time.perf_counter() - start)


def quantiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"median": statistics.median(samples), "p90": p90, "samples": samples}


def gather_to_first(obj) -> list | None:
    """Every rank's ``obj`` in rank order on rank 0 (collective); ``None`` on the others."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def finish_worker(args: argparse.Namespace, out: dict | None) -> None:
    """Write rank 0's ``out`` where the launcher reads it, then close the process groups."""
    if out is not None:
        Path(args.worker).write_text(json.dumps(out, indent=2))
    from attnres_dist.parallel.process_groups import shutdown_distributed

    shutdown_distributed()
