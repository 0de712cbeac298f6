"""The training loop end to end: the default config trains, runs repeat, outputs are written."""

from __future__ import annotations

import json
import math

import pytest

from attnres_dist.config import OptimConfig, load_config
from attnres_dist.optim import lr_factor
from tests.conftest import run_job

FAST = [
    "train.steps=4",
    "optim.warmup_steps=1",
    "train.eval_every=2",
    "train.eval_batches=2",
    "train.log_every=1",
    "train.progress=false",
]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_default_config_trains_as_a_pipeline(tmp_path):
    """configs/tiny.yaml as shipped (2-stage pipeline, embedded corpus), a few steps."""
    run_dir = tmp_path / "run"
    run_job(
        [
            "-m",
            "attnres_dist.cli",
            "train",
            "--config",
            "configs/tiny.yaml",
            *FAST,
            f"output.run_dir={run_dir}",
            "train.peak_tflops=0.5",
        ],
        nproc=2,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and math.isfinite(summary["final_valid_loss"])
    assert summary["train_losses"][-1] < summary["train_losses"][0]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["kind"] == "valid"] == [2, 4]
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in train)
    assert all(r["grad_norm"] > 0 and r["lr"] > 0 for r in train)
    assert all(len(r["peak_memory_mb_per_rank"]) == 2 for r in train)  # gathered from both
    assert all(r["peak_memory_mb"] == max(r["peak_memory_mb_per_rank"]) > 0 for r in train)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert load_config(run_dir / "config.yaml").parallel.pp == 2


@pytest.mark.slow
def test_single_process_runs_repeat_exactly(tmp_path, small_dataset):
    losses = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        run_job(
            [
                "-m",
                "attnres_dist.cli",
                "train",
                "--config",
                "configs/tiny.yaml",
                *FAST,
                "parallel.pp=1",
                f"data.path={small_dataset}",
                f"output.run_dir={run_dir}",
                "model.seq_length=64",
            ],
        )
        losses.append(json.loads((run_dir / "summary.json").read_text())["train_losses"])
    assert losses[0] == losses[1]


def test_lr_schedule_warmup_then_cosine():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    factors = [lr_factor(step, optim, total_steps=14) for step in range(14)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert lr_factor(14, optim, 14) == pytest.approx(0.1)
