"""The GPU study (``make gpu-study``): baseline vs Block vs Full AttnRes, sized to the lease.

A step of the GPU check (``--only study``), run after the install steps. On the GPU:

1. the data: a byte-level corpus of the machine's installed Python sources
   (``data/code_corpus.py``, 256 MB at most, under a minute), no download;
2. calibration: a short Full AttnRes run (the slowest variant) measures the start-up and the
   step time of ``configs/study-gpu-1.yaml`` on this machine;
3. the plan: the most steps that let every run finish in the step's time limit, equal for
   every variant (equal tokens, the same data order); two peak learning rates when each run
   still gets ``MIN_STEPS`` steps, else one;
4. the runs: ``studies/study.py``'s driver (one seed; instrumentation every 50 steps), which
   also writes ``results-gpu.md`` with its figures and reading;
5. what comes back: ``study.tar.gz`` in the check's output directory (the results, their
   figures and each run's config, metrics, depth statistics and summary), and in
   ``gpu_check.json`` the plan, the corpus's size and file-list hash, each run's final
   validation loss, tokens/s and wall time, and a noise estimate: the spread of the
   baseline's validation loss over its last evaluations.

``attnres-dist`` turns the archive into docs/results-gpu.md on any machine
(docs/results.md, "The GPU study"). A dry run (CPU) keeps the path and shrinks every size.
"""

from __future__ import annotations

import json
import os
import tarfile
import time
from pathlib import Path

CONFIG = "configs/study-gpu-1.yaml"
VARIANTS = ("baseline", "block", "full", "delta_block", "delta_full")
LRS = (1e-3, 3e-3)  # two rates when the budget allows; the first alone when it does not
MIN_STEPS = 500  # fewer steps per run than this at two rates: one rate instead
CALIBRATION_STEPS = 30
CORPUS_BYTES = 256 << 20
DRY = [  # a dry run keeps the code path, not the size
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "model.attnres.block_size=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_batches=2",
    "metrics.every_k=5",
    "runtime.dtype=fp32",
]
KEEP = ("config.yaml", "metrics.jsonl", "diagnostics.jsonl", "summary.json")


def _records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def calibrate(common: list[str], work: Path) -> tuple[float, float]:
    """(start-up seconds, seconds per step) of the slowest variant on this machine."""
    from studies import study

    run_dir = work / "calibration"
    args = study.parse_args(["--config", CONFIG, "--out", str(work), *common])
    args.nproc, args.min_lr_ratio = 1, 0.1
    overrides = [f"train.steps={CALIBRATION_STEPS}", "train.eval_every=0", "metrics.every_k=0"]
    overrides.append("optim.warmup_steps=5")
    args.overrides = [*args.overrides, *overrides]
    start = time.perf_counter()
    study.train_one(args, "full", 1)
    os.replace(work / study.run_name("full", 1), run_dir)
    wall = time.perf_counter() - start
    times = {r["step"]: r["time_s"] for r in _records(run_dir, "train")}
    first, last = min(times), max(times)
    per_step = (times[last] - times[first]) / max(last - first, 1)
    return max(wall - per_step * CALIBRATION_STEPS, 0.0), per_step


def plan(limit_s: float, startup_s: float, step_s: float, dry: bool) -> tuple[int, list[float]]:
    """(steps per run, learning rates): every run fits ``limit_s`` with 15% to spare."""
    if dry:  # the path, not the size: one rate (the driver's sweep has its own test)
        return 20, list(LRS[:1])
    for lrs in (list(LRS), list(LRS[:1])):
        per_run = 0.85 * limit_s / (len(VARIANTS) * len(lrs)) - startup_s
        steps = int(per_run / step_s) if per_run > 0 else 0
        if steps >= MIN_STEPS or len(lrs) == 1:
            return max(steps, 10), lrs
    raise AssertionError("unreachable")


def noise(run_dir: Path, last: int = 3) -> float | None:
    """Spread (max - min) of a run's last ``last`` validation losses: how much the number the
    study compares moves between nearby evaluations of one run."""
    losses = [r["loss"] for r in _records(run_dir, "valid")][-last:]
    return round(max(losses) - min(losses), 4) if len(losses) >= 2 else None


def machine() -> str:
    """The accelerator and software the runs used (the results' Machine line)."""
    import platform

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{device}, {os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}"


def archive(out: Path, work: Path, run_dirs: list[Path]) -> Path:
    """``study.tar.gz``: results-gpu.md, its figures, the machine line, each run's kept files."""
    path = out / "study.tar.gz"
    (work / "machine.txt").write_text(machine() + "\n")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(work / "machine.txt", "machine.txt")
        tar.add(work / "results-gpu.md", "results-gpu.md")
        if (work / "results-gpu").is_dir():
            tar.add(work / "results-gpu", "results-gpu")
        for run_dir in run_dirs:
            for name in KEEP:
                if (run_dir / name).is_file():
                    tar.add(run_dir / name, f"runs/{run_dir.name}/{name}")
    return path


def study_runs(work: Path, dry: bool) -> dict:
    from attnres_dist.data.code_corpus import build_code_corpus
    from gpu_check.common import save_result, step_limit_s
    from studies import study

    deadline = time.monotonic() + step_limit_s(540)
    result: dict = {"config": CONFIG}
    start = time.perf_counter()
    prefix = str(work / "code" / "corpus")
    meta = build_code_corpus(prefix, max_bytes=(2 << 20) if dry else CORPUS_BYTES)
    result["corpus"] = {
        "seconds": round(time.perf_counter() - start, 1),
        "files": meta["files"],
        "bytes": meta["bytes"],
        "train_tokens": meta["splits"]["train"]["tokens"],
        "valid_tokens": meta["splits"]["valid"]["tokens"],
        "file_list_sha256": meta["file_list_sha256"],
    }
    save_result(result)
    common = [f"data.path={prefix}", "output.tensorboard=false", *(DRY if dry else [])]
    startup, per_step = calibrate(common, work)
    steps, lrs = plan(deadline - time.monotonic(), startup, per_step, dry)
    result["plan"] = {
        "calibration": {"startup_s": round(startup, 1), "step_s": round(per_step, 4)},
        "steps": steps,
        "lrs": lrs,
        "variants": list(VARIANTS),
    }
    save_result(result)
    every = max(steps // 5, 1)
    overrides = [f"train.steps={steps}", f"train.eval_every={every}"]
    overrides.append(f"optim.warmup_steps={max(steps // 20, 1)}")
    results = work / "results-gpu.md"
    args = ["--config", CONFIG, "--out", str(work / "runs"), "--results", str(results)]
    args += [*common, *overrides, "--seeds", "1", "--lrs", *map(str, lrs)]  # overrides first
    code = study.main(args)
    run_dirs = sorted(p for p in (work / "runs").iterdir() if p.is_dir())
    result["runs"] = []
    for run_dir in run_dirs:
        summary = json.loads((run_dir / "summary.json").read_text())
        result["runs"].append(
            {
                "run": run_dir.name,
                "final_valid_loss": summary.get("final_valid_loss"),
                "tokens_per_s": summary.get("tokens_per_s"),
                "wall_s": summary.get("wall_time_s"),
            }
        )
    from attnres_dist.config import load_config

    cfg = load_config(CONFIG, [*common, *overrides])
    tokens = steps * cfg.train.global_batch_size * cfg.model.seq_length
    result |= {"exit": code, "tokens_per_run": tokens, "machine": machine()}
    base = [p for p in run_dirs if p.name.startswith("baseline")]
    result["noise_last_evals"] = {p.name: noise(p) for p in base}
    out = Path(os.environ.get("GPU_CHECK_OUT", work))
    result["archive"] = str(archive(out, work, run_dirs))
    return result
