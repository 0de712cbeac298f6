"""Run directories read back: their config, losses, diagnostics and timing, grouped by variant.

A run directory holds ``config.yaml``, ``metrics.jsonl``, ``summary.json`` and, with
``metrics.every_k > 0``, ``diagnostics.jsonl``. Runs whose configs differ only in the seed and
the run directory are one *variant* (the seeds of a study); a variant's depth profiles are the
mean over its seeds of each run's profile, and a run's profile is the mean over its measured
steps in the last half of training, where single measurements are less noisy than one step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Run:
    path: Path
    config: dict
    metrics: list[dict]
    measures: list[dict]
    timing: dict | None
    summary: dict | None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def seed(self) -> int:
        return self.config["train"]["seed"]

    @property
    def steps(self) -> int:
        return self.config["train"]["steps"]

    @property
    def mode(self) -> str:
        return self.config["model"]["attnres"]["mode"]

    def curve(self, kind: str, key: str = "loss") -> tuple[np.ndarray, np.ndarray]:
        rows = [r for r in self.metrics if r.get("kind") == kind and key in r]
        return np.array([r["step"] for r in rows]), np.array([r[key] for r in rows], float)

    @property
    def final_valid_loss(self) -> float | None:
        if self.summary is not None:
            return self.summary.get("final_valid_loss")
        _, losses = self.curve("valid")
        return float(losses[-1]) if len(losses) else None

    def late_measures(self) -> list[dict]:
        """Measured steps in the last half of training (all of them if none is that late)."""
        late = [m for m in self.measures if m["step"] > self.steps / 2]
        return late or self.measures


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{path}: not a run directory (no config.yaml)")
    config = yaml.safe_load((path / "config.yaml").read_text())
    diag = _jsonl(path / "diagnostics.jsonl")
    timing = [r for r in diag if r.get("kind") == "timing"]
    summary = path / "summary.json"
    return Run(
        path=path,
        config=config,
        metrics=_jsonl(path / "metrics.jsonl"),
        measures=[r for r in diag if r.get("kind") == "measure"],
        timing=timing[-1] if timing else None,
        summary=json.loads(summary.read_text()) if summary.is_file() else None,
    )


# -------------------------------------------------------------------------- depth profiles


def _mean_rows(rows: list[list[float | None]]) -> np.ndarray:
    """Column means of ragged rows, None/missing ignored (NaN where no row has a value)."""
    width = max((len(r) for r in rows), default=0)
    table = np.full((len(rows), width), np.nan)
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if value is not None:
                table[i, j] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns stay NaN
        return np.nanmean(table, axis=0)


def nanmean_rows(arrays: list[np.ndarray]) -> np.ndarray:
    """Element-wise mean of same-shape arrays, NaN ignored (NaN where all are NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.stack(arrays), axis=0)


def sublayer_profile(run: Run, key: str) -> np.ndarray:
    """Per-sublayer mean of ``in_rms`` / ``out_rms`` / ``state_rms`` over late measurements."""
    rows = [[s[key] if s else None for s in m["sublayers"]] for m in run.late_measures()]
    return _mean_rows(rows)


def grad_profile(run: Run, key: str = "layers") -> np.ndarray:
    """Per-layer (or ``sublayers`` / ``blocks``) gradient norm, mean over late measurements."""
    return _mean_rows([m["grad_norm"][key] for m in run.late_measures()])


def weight_stat_profile(run: Run, stat: str) -> np.ndarray:
    """Per-sublayer ``max`` or normalised ``entropy`` (entropy / log n; NaN for n = 1)."""
    rows = []
    for m in run.late_measures():
        row = []
        for s in m["sublayers"]:
            w = s.get("weights") if s else None
            if w is None:
                row.append(None)
            elif stat == "entropy":
                n = w["num_sources"]
                row.append(w["entropy"] / math.log(n) if n > 1 else None)
            else:
                row.append(w[stat])
        rows.append(row)
    return _mean_rows(rows)


def attention_matrix(run: Run, kind: str) -> tuple[np.ndarray, list[str]]:
    """Mean depth-attention weight ``[row, source]`` for ``kind`` = ``attn`` or ``mlp``.

    Rows are transformer layers (the MLP matrix gets the final aggregation as a last row);
    column j is source j: the embedding, then block j (Full: sublayer output v_j), the last
    column of a row being the partial block when the row's sublayer reads one.
    """
    offset = 1 if kind == "attn" else 2
    num_layers = run.config["model"]["num_layers"]
    measures = run.late_measures()
    rows, labels = [], []
    for layer in range(num_layers):
        index = 2 * layer + offset - 1
        rows.append(
            _mean_rows(
                [m["sublayers"][index]["weights"]["mean"] for m in measures if _has_w(m, index)]
            )
        )
        labels.append(f"L{layer}")
    if kind == "mlp":
        finals = [
            m["final"]["weights"]["mean"] for m in measures if (m.get("final") or {}).get("weights")
        ]
        rows.append(_mean_rows(finals))
        labels.append("final")
    width = max((len(r) for r in rows), default=0)
    matrix = np.full((len(rows), width), np.nan)
    for i, row in enumerate(rows):
        matrix[i, : len(row)] = row
    return matrix, labels


def _has_w(measure: dict, index: int) -> bool:
    s = measure["sublayers"][index]
    return bool(s and s.get("weights"))


# -------------------------------------------------------------------------- variants


def variant_label(config: dict) -> str:
    attnres = config["model"]["attnres"]
    if attnres["mode"] in ("block", "delta_block"):
        return f"{attnres['mode']} S={attnres['block_size']}"
    return attnres["mode"]


def _with_defaults(config: dict, defaults: dict) -> dict:
    """``config`` with every field it lacks at its default: a run saved before a field existed
    ran as that field's default does, and groups with the runs saved after."""
    out = dict(config)
    for key, default in defaults.items():
        if key not in out:
            out[key] = default
        elif isinstance(default, dict) and isinstance(out[key], dict):
            out[key] = _with_defaults(out[key], default)
    return out


@functools.cache
def _default_config() -> str:
    """Every config field at its default, as JSON (built once)."""
    from attnres_dist.config import load_config

    return json.dumps(dataclasses.asdict(load_config(None, [])), default=str)


def _variant_key(config: dict) -> str:
    c = _with_defaults(json.loads(json.dumps(config)), json.loads(_default_config()))
    c["train"].pop("seed", None)
    c.get("output", {}).pop("run_dir", None)
    c.pop("checkpoint", None)  # where and how often a run saves does not change the variant
    return json.dumps(c, sort_keys=True)


@dataclass
class Variant:
    label: str
    runs: list[Run] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return self.runs[0].mode

    @property
    def config(self) -> dict:
        return self.runs[0].config

    def valid_losses(self) -> list[float]:
        return [r.final_valid_loss for r in self.runs if r.final_valid_loss is not None]

    def mean_profile(self, fn, *args) -> np.ndarray:
        return _mean_rows([list(fn(r, *args)) for r in self.runs if r.measures])

    def mean_curve(self, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Steps, mean and std over seeds of a loss curve (steps every run logged)."""
        curves = [r.curve(kind) for r in self.runs]
        common = set(curves[0][0].tolist())
        for steps, _ in curves[1:]:
            common &= set(steps.tolist())
        steps = np.array(sorted(common))
        values = np.array(
            [[dict(zip(s.tolist(), v, strict=True))[k] for k in steps] for s, v in curves]
        )
        return steps, values.mean(axis=0), values.std(axis=0)


def group_runs(runs: list[Run]) -> list[Variant]:
    """Runs grouped by variant, in first-seen order; labels made unique by run names."""
    groups: dict[str, Variant] = {}
    for run in runs:
        groups.setdefault(_variant_key(run.config), Variant(variant_label(run.config))).runs.append(
            run
        )
    variants = list(groups.values())
    labels = [v.label for v in variants]
    for v in variants:
        if labels.count(v.label) > 1:
            v.label = f"{v.label} ({v.runs[0].name})"
    return variants


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    arr = np.array(values, float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0
