"""The study's report read from run results, without training: the plain-language reading
(a difference against seed noise; no cost read from runs that shared the machine) and the
grouping of runs into variants (a run saved before a config field existed joins the later
ones)."""

from __future__ import annotations

import json
import math

from attnres_dist.config import load_config
from attnres_dist.diagnostics.reading import reading


def test_reading_tells_a_difference_from_seed_noise():
    def stats(label, mode, losses):
        mean = sum(losses) / len(losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in losses) / (len(losses) - 1))
        return {"label": label, "mode": mode, "seeds": 3, "valid_mean": mean, "valid_std": std}

    base = stats("baseline", "baseline", [2.00, 2.01, 1.99])
    text = "\n".join(
        reading(
            [
                base,
                stats("block S=3", "block", [1.90, 1.91, 1.89]),
                stats("full", "full", [2.00, 2.02, 1.99]),
            ]
        )
    )
    assert "**block S=3**" in text and "**better** than the baseline" in text
    assert "- **full**" in text and "within seed noise" in text


def test_runs_saved_before_a_field_existed_group_with_later_ones():
    """A run's config saved before a field was added (so without it) is the same variant as
    one saved after with the field at its default; a field set otherwise is another variant."""
    import dataclasses
    from pathlib import Path

    from attnres_dist.diagnostics.runs import Run, group_runs

    def run(name, seed, **runtime):
        config = json.loads(json.dumps(dataclasses.asdict(load_config(None, [])), default=str))
        config["train"]["seed"] = seed
        config["runtime"].update(runtime)
        return Run(Path(name), config, [], [], None, None)

    old = run("old", 1)
    del old.config["runtime"]["cuda_graphs"]  # saved before the field existed
    variants = group_runs([old, run("new", 2), run("other", 3, cuda_graphs="off")])
    assert [[r.name for r in v.runs] for v in variants] == [["old", "new"], ["other"]]


def test_reading_of_runs_that_shared_the_machine_reads_no_cost():
    base = {"label": "baseline", "mode": "baseline", "seeds": 1, "valid_mean": 2.0}
    block = {"label": "block S=3", "mode": "block", "seeds": 1, "valid_mean": 1.9}
    base["wall_mean"], block["wall_mean"] = 100.0, 180.0  # a neighbour's load, not AttnRes
    timed, shared = reading([base, block]), reading([base, block], timed=False)
    assert any("(+80% wall time)" in line for line in timed)
    assert not any("wall time)" in line for line in shared)
    assert any(line.startswith("- Cost: not read from this study") for line in shared)


def test_results_table_compares_wall_time_at_the_same_learning_rate_and_not_when_shared():
    from attnres_dist.diagnostics.report import variant_table

    def row(label, mode, lr, wall):
        return {
            "label": label, "mode": mode, "lr": lr, "seeds": 1, "valid_mean": 2.0,
            "valid_std": 0.0, "wall_mean": wall, "tokens_per_s": None, "measured_step_s": None,
            "unmeasured_step_s": None, "instrument_share": None,
        }  # fmt: skip

    rows = [
        row("baseline, lr 0.001", "baseline", 1e-3, 300.0),  # slowed by a neighbour
        row("block, lr 0.001", "block", 1e-3, 330.0),
        row("baseline, lr 0.003", "baseline", 3e-3, 100.0),
        row("block, lr 0.003", "block", 3e-3, 150.0),
    ]
    relative = [line.split(" | ")[4] for line in variant_table(rows)[2:]]
    assert relative == ["+0.0%", "+10.0%", "+0.0%", "+50.0%"]
    shared = [line.split(" | ")[4] for line in variant_table(rows, timed=False)[2:]]
    assert shared == ["–"] * 4
