"""The study behind ``make study``: baseline vs Block, Full, Delta Block and Delta Full AttnRes,
several seeds each.

    python -m studies.study [--config configs/study-cpu.yaml] [--quick]

Every variant trains the same config (same layers, tokens, data order and hyper-parameters;
AttnRes only adds its per-sublayer query and key gain) with ``model.attnres.mode`` set to
``baseline``, ``block`` (the config's block size), ``full``, ``delta_block`` (the same block
size) or ``delta_full``, once per seed, as
``attnres-dist train`` subprocesses (under ``torchrun`` when the config's layout needs more
than one process). Finished runs
(``summary.json`` present) are kept, so an interrupted study resumes where it stopped;
unfinished run directories are started afresh. Then ``--results`` gets the markdown results
(tables, figures in ``<results stem>/``, and a reading of the numbers, see ``reading``).

``--lrs 1e-3 3e-3 6e-3`` sweeps the peak learning rate (the final rate keeps the config's
ratio to it): every variant at every rate and seed, then a table of each variant at its best
rate (``lr_sweep``), which the reading compares, beside the table of every run.

``--quick`` checks the whole path in a few minutes: two variants, one seed, 20 steps, into a
temporary directory (never ``docs/results.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnres_dist.diagnostics import plots, report
from attnres_dist.diagnostics import runs as R
from attnres_dist.diagnostics.reading import reading
from studies import lr_sweep

VARIANTS = ("baseline", "block", "full", "delta_block", "delta_full")
DOCS = Path(__file__).resolve().parents[1] / "docs"
QUICK = [
    "train.steps=20",
    "optim.warmup_steps=5",
    "train.eval_every=10",
    "train.eval_batches=2",
    "train.log_every=5",
    "metrics.every_k=5",
]


def run_name(variant: str, seed: int, lr: float | None = None) -> str:
    return f"{variant}-seed{seed}" if lr is None else f"{variant}-lr{lr:g}-seed{seed}"


def lr_overrides(args, lr: float | None) -> list[str]:
    """A swept rate, with the config's ratio of final to peak rate kept."""
    if lr is None:
        return []
    return [f"optim.lr={lr!r}", f"optim.min_lr={lr * args.min_lr_ratio!r}"]


def train_command(args, variant: str, seed: int, run_dir: Path, lr=None) -> list[str]:
    train = [
        "-m",
        "attnres_dist.cli",
        "train",
        "--config",
        args.config,
        f"model.attnres.mode={variant}",
        f"train.seed={seed}",
        f"output.run_dir={run_dir}",
        "train.progress=false",
        *lr_overrides(args, lr),
        *args.overrides,
    ]
    if args.nproc == 1:
        return [sys.executable, *train]
    from attnres_dist.parallel.launch_env import free_port

    torchrun = Path(sys.executable).parent / "torchrun"
    return [str(torchrun), f"--nproc_per_node={args.nproc}", f"--master_port={free_port()}", *train]


def train_one(args, variant: str, seed: int, lr: float | None = None) -> Path:
    run_dir = Path(args.out) / run_name(variant, seed, lr)
    if (run_dir / "summary.json").is_file():
        print(f"  {run_dir.name}: done earlier, kept", flush=True)
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)  # unfinished: its appended logs would mix two attempts
    run_dir.mkdir(parents=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if args.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # one core per rank (DESIGN.md section 4)
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        code = subprocess.call(
            train_command(args, variant, seed, run_dir, lr),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if code != 0:
        tail = (run_dir / "train.log").read_text().splitlines()[-15:]
        raise SystemExit(f"{run_dir.name} failed (exit {code}):\n" + "\n".join(tail))
    print(f"  {run_dir.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return run_dir


def parameter_count(run_dir: Path) -> int | None:
    """The count the trainer prints when it starts (every parameter once)."""
    log = run_dir / "train.log"
    match = re.search(r"([\d,]+) parameters", log.read_text()) if log.is_file() else None
    return int(match.group(1).replace(",", "")) if match else None


def setup_lines(args, variants: list[R.Variant], total_s: float) -> list[str]:
    c = variants[0].config
    m, t, o = c["model"], c["train"], c["optim"]
    counts = {}  # one count per architecture: the learning rate does not change it
    for v in variants:
        if v.runs:
            counts.setdefault(R.variant_label(v.config), parameter_count(v.runs[0].path) or 0)
    params = ", ".join(f"{label} {n:,}" for label, n in counts.items())
    tokens = t["steps"] * t["global_batch_size"] * m["seq_length"]
    lrs = getattr(args, "lrs", None)
    rate = f"lr swept over {', '.join(f'{lr:g}' for lr in lrs)}" if lrs else f"lr {o['lr']}"
    decay = f"{o['min_lr'] / o['lr']:g} x the peak" if lrs else o["min_lr"]
    block = next((v for v in variants if v.mode == "block"), None)
    blocks = ""
    if block is not None:
        S = m["attnres"]["block_size"]
        blocks = (
            f"; Block AttnRes: S = {S} sublayers per block, {-(-2 * m['num_layers'] // S)} blocks"
        )
    return [
        f"- Model: {m['num_layers']} layers x hidden {m['hidden_size']}, "
        f"{m['num_attention_heads']} heads, sequence {m['seq_length']}{blocks}.",
        f"- Parameters: {params}.",
        f"- Training: {t['steps']} steps x {t['global_batch_size']} sequences = {tokens:,} tokens "
        f"per run; AdamW {rate} (warm-up {o['warmup_steps']}, cosine to {decay}), "
        f"weight decay {o['weight_decay']}, clip {o['grad_clip']}; validation on "
        f"{t['eval_batches']} x {t['micro_batch_size']} held-out windows.",
        f"- Seeds: {', '.join(str(r.seed) for r in variants[0].runs)} (the seed sets the "
        "initialisation and the data order; each seed is shared by all variants).",
        f"- Config: `{args.config}` {' '.join(args.overrides)}; {args.nproc} process(es); "
        f"instrumentation every {c.get('metrics', {}).get('every_k')} steps.",
        machine_line(args, total_s),
    ]


def machine_line(args, total_s: float) -> str:
    """This machine and the study's duration, or ``--machine`` for runs trained elsewhere."""
    if getattr(args, "machine", None):
        return f"- Machine: {args.machine} (where the runs trained)."
    return (
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, "
        f"torch {torch.__version__}; the whole study took {total_s / 60:.1f} min."
    )


def write_results(args, run_dirs: list[Path], total_s: float) -> Path:
    results = Path(args.results)
    figure_dir = results.parent / results.stem
    variants = R.group_runs([R.load_run(d) for d in run_dirs])
    lr_sweep.label_with_lr(variants)
    figures = plots.render_all(variants, figure_dir)
    stats = [{**report.variant_stats(v), "lr": lr_sweep.lr_of(v)} for v in variants]
    timed = not getattr(args, "shared_machine", False)
    best = lr_sweep.best_per_architecture(variants, stats)
    swept = len(best) < len(stats)
    best_section = [
        "## Each variant at its best learning rate",
        "",
        *lr_sweep.best_lr_table(best),
        "",
        "The reading below compares these. Every rate tried is in the next table.",
        "",
    ]
    lines = [
        "# Study: baseline vs Block AttnRes vs Full AttnRes",
        "",
        "Reproduce with `make study` (this file and its figures are rewritten).",
        "",
        "## Setup",
        "",
        *setup_lines(args, variants, total_s),
        "",
        *(best_section if swept else []),
        "## Results",
        "",
        *report.variant_table(stats, timed),
        "",
        "*instrumentation cost*: median time spent inside the instrumentation on a measured "
        "step, as a share of a median plain step (and spread over the k steps it covers); then "
        "the end-to-end difference of median measured and plain step times (rank 0's wall "
        "clock, first step excluded), which other jobs on a shared machine can swamp. See "
        f"[diagnostics.md]({os.path.relpath(DOCS / 'diagnostics.md', results.parent)}).",
        "",
        "## Reading",
        "",
        *reading(best if swept else stats, timed),
        "",
        "## Depth statistics",
        "",
        report.DEPTH_NOTE,
        "",
        *report.depth_table(stats),
        "",
        "## Runs",
        "",
        *report.run_table(variants),
        "",
        "## Figures",
        "",
        *report.figure_lines(figures, results.parent),
    ]
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("\n".join(lines))
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/study-cpu.yaml")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument(
        "--lrs", nargs="+", type=float, default=None, help="peak learning rates to sweep"
    )
    parser.add_argument("--out", default="runs/study", help="directory of the run directories")
    parser.add_argument("--results", default="docs/results.md")
    parser.add_argument("--quick", action="store_true", help="2 variants x 1 seed x 20 steps")
    parser.add_argument(
        "--machine", default=None, help="the Machine line, for finished runs trained elsewhere"
    )
    parser.add_argument(
        "--shared-machine",
        action="store_true",
        help="the runs shared the machine (with each other or other jobs): do not read their "
        "wall times as AttnRes's cost",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run")
    args = parser.parse_args(argv)
    if args.quick:
        args.variants, args.seeds = ["baseline", "block"], [1]
        args.overrides = [*QUICK, *args.overrides]
        args.out = tempfile.mkdtemp(prefix="attnres-study-")
        args.results = str(Path(args.out) / "results.md")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from attnres_dist.config import load_config

    cfg = load_config(args.config, args.overrides)  # fail on a bad config before any run
    args.nproc = cfg.world_size
    args.min_lr_ratio = cfg.optim.min_lr / cfg.optim.lr
    rates = args.lrs or [None]
    print(
        f"study: {len(args.variants)} variants x {len(rates)} learning rates x "
        f"{len(args.seeds)} seeds, "
        f"{cfg.model.num_layers} layers x {cfg.model.hidden_size}, {cfg.train.steps} steps "
        f"-> {args.out}",
        flush=True,
    )
    start = time.perf_counter()
    # seed-major order: an interrupted study still has every variant at the seeds it finished
    run_dirs = [
        train_one(args, v, s, lr) for s in args.seeds for lr in rates for v in args.variants
    ]
    path = write_results(args, run_dirs, time.perf_counter() - start)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
