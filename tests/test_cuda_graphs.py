"""CUDA graphs (``runtime.cuda_graphs: on``) against eager, on a GPU (``@pytest.mark.cuda``:
skipped without one; the GPU check's ``cuda_tests`` step runs it).

One GPU, DeepSpeed's pipeline engine (bf16 goes through it even at pp = 1), bf16, compiled
per layer with hidden dropout 0.1 (the layout-independent streams re-seed the generator before
every layer, so a replayed graph must read the seed at replay), four micro-batches per step
(several forwards per generation of the graph trees), with and without full recompute (the
checkpoint re-runs a compiled region inside backward); and compiled per chunk
(``runtime.compile: chunk``, no dropout). Six optimizer steps: the first warms up, the second
records, the rest replay. The reference is the eager run of the same config
(``runtime.compile: off``); the compiled run without graphs separates a compiler difference
from a replay one.
Tolerances are bf16's: the losses of the compiled and eager bf16 runs differed by 1.3e-4
relative after 3 steps (docs/compile.md); 5e-3 relative leaves room for 6 steps and stays far
below what a wrong dropout mask moves (a different draw of p = 0.1 masks).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, child_env
from tests.equivalence_helpers import overrides

DRIVER = """
import json, sys
from torch._dynamo.utils import counters
from attnres_dist.config import load_config
from attnres_dist.train.trainer import Trainer
trainer = Trainer(load_config(None, sys.argv[1:]))
summary = trainer.train()
print(json.dumps({
    "losses": summary["train_losses"],
    "runtime": trainer.runtime.describe(),
    "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
}))
"""


def _run(
    small_dataset, tmp_path, name: str, recompute: str, *extra: str, dropout: float = 0.1
) -> dict:
    ops = {
        "model.attnres.impl": "twophase",
        "runtime.fused_norm": "off",
        "model.hidden_dropout": dropout,
        "parallel.recompute": recompute,
        "train.steps": 6,
    }
    args = overrides(small_dataset, "block", str(tmp_path / name), **ops)
    args += ["runtime.dtype=bf16", "runtime.layer_spec=local", "checkpoint.every=0", *extra]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.cuda
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_graph_replay_trains_like_eager_in_bf16(small_dataset, tmp_path, recompute):
    _check_replay(small_dataset, tmp_path, recompute, "layer", 0.1)


@pytest.mark.cuda
def test_chunk_graph_replay_trains_like_eager_in_bf16(small_dataset, tmp_path):
    """``runtime.compile: chunk`` (the GPU check's speed rows): at pp = 1 the model's layers
    one region, one graph tree over all of them; no dropout (``chunk`` refuses it)."""
    _check_replay(small_dataset, tmp_path, "none", "chunk", 0.0)


def _check_replay(small_dataset, tmp_path, recompute: str, compile: str, dropout: float):
    def run(name, *extra):
        return _run(small_dataset, tmp_path, name, recompute, *extra, dropout=dropout)

    eager = run("eager", "runtime.compile=off")
    compiled = run("compiled", f"runtime.compile={compile}")
    graphed = run("graphed", f"runtime.compile={compile}", "runtime.cuda_graphs=on")
    assert "cuda_graphs=on" in graphed["runtime"] and "cuda_graphs=off" in compiled["runtime"]
    assert graphed["cudagraph_skips"] == 0, "inductor ran some region without CUDA graphs"
    assert len(graphed["losses"]) == 6
    for ref, other in (("eager", graphed), ("eager", compiled)):
        for a, b in zip(other["losses"], eager["losses"], strict=True):
            assert abs(a - b) <= 5e-3 * max(1.0, abs(b)), (ref, other["losses"], eager["losses"])
    for a, b in zip(graphed["losses"], compiled["losses"], strict=True):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(b)), (graphed["losses"], compiled["losses"])
