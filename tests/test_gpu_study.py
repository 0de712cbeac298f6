"""The GPU study's step, dry (CPU, tiny shape): the whole path a lent GPU would run.

The corpus is built, a calibration run times the slowest variant, the plan gives every run
the same steps, the study driver trains baseline, Block and Full (one learning rate: the
sweep has its own test in test_diagnostics.py) and writes its results, ``study.tar.gz`` holds
what a reader needs, and ``gpu.md`` gets its section. Then the planning rule on hand-made
numbers.
"""

from __future__ import annotations

import json
import tarfile

import pytest

from gpu_check import report, study_step


@pytest.mark.slow
def test_dry_study_runs_every_variant_and_archives_the_results(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("GPU_CHECK_OUT", str(out))
    monkeypatch.setenv("GPU_CHECK_STEP_S", "600")
    result = study_step.study_runs(tmp_path / "work", dry=True)
    assert result["exit"] == 0 and result["corpus"]["files"] > 10
    assert result["plan"]["steps"] == 20 and result["plan"]["lrs"] == [1e-3]
    names = sorted(r["run"] for r in result["runs"])
    variants = ("baseline", "block", "delta_block", "delta_full", "full")
    assert names == [f"{v}-lr0.001-seed1" for v in variants]
    assert all(r["final_valid_loss"] and r["tokens_per_s"] for r in result["runs"])
    assert result["tokens_per_run"] == 20 * 2 * 32
    with tarfile.open(out / "study.tar.gz") as tar:
        members = set(tar.getnames())
        results = tar.extractfile("results-gpu.md").read().decode()
    assert {"results-gpu.md", "machine.txt", "runs/full-lr0.001-seed1/metrics.jsonl"} <= members
    assert "runs/block-lr0.001-seed1/diagnostics.jsonl" in members
    assert "## Results" in results and "## Depth statistics" in results
    summary = {"steps": [{"name": "study", "status": "ok", "what": "", "result": result}]}
    lines = "\n".join(report._study(report._by_name(summary)))
    assert "Plan: 20 steps per run" in lines and "baseline-lr0.001-seed1" in lines
    json.dumps(result)  # what gpu_check.json stores


def test_plan_fits_the_limit_and_falls_back_to_one_rate():
    # 540 s, 20 s start-up, 0.04 s a step: 10 runs (5 variants, 2 rates) get
    # 0.85 * 540 / 10 - 20 = 25.9 s -> 647 steps
    assert study_step.plan(540, 20, 0.04, dry=False) == (647, [1e-3, 3e-3])
    # 0.15 s a step: 172 steps at two rates (< 500), so one rate: 0.85 * 540 / 5 - 20 = 71.8 s
    assert study_step.plan(540, 20, 0.15, dry=False) == (478, [1e-3])
