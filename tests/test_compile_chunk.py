"""Compiled chunks (``runtime.compile: chunk``): a run of layers as one graph, the same numbers.

* One region per run: the consecutive layers of a chunk trace as ONE graph with no break
  (TorchDynamo's ``explain``); the first training step compiles one graph per run and one for
  the final aggregation (a run per model without recompute, one per recompute group under full
  recompute), a second step nothing.
* Same numbers: the loss and every parameter's gradient of the chunk-compiled model equal the
  eager model's with the same weights and ops within 1e-5 (fp32): baseline, Block with an
  uneven last block and Full under inductor; ``attnres`` recompute inside the run and ``full``
  recompute around runs of two layers (aot_eager); an evaluation after training steps (its own
  graphs). 4 training steps of DeepSpeed's engine at pp = 1 (inductor, the whole model one
  run; full recompute, interval 2: a run per group), pp = 2 on 1F1B (aot_eager, a run per
  stage) and tp = 2 (aot_eager, the tensor-parallel reductions inside the run's graph) equal
  the eager single process's losses and parameters within 1e-5.
* Several models in one process (their steps interleaved, under the steady stance) each run
  their own graphs.
* Refusals: dropout (each layer seeds its own streams outside a graph) is a one-line error
  naming ``runtime.compile``.
The eager model is the reference: nothing here compares the compiled model to itself.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from attnres_dist.config import OptimConfig, load_config
from attnres_dist.errors import ConfigError
from attnres_dist.model.compiled_region import state_region
from attnres_dist.model.sequence_context import sequence_context
from attnres_dist.runtime.select import select_runtime
from attnres_dist.train.local_engine import LocalEngine
from tests.equivalence_helpers import (
    assert_matches,
    overrides,
    single_process_reference,
    train_case,
)
from tests.test_compile import (  # MODES: block size 4 of 6 sublayers leaves an uneven block
    MODES,
    assert_same_numbers,
    loss_and_grads,
    process_group,  # noqa: F401  (autouse: the single-process group, here too)
    window,
)
from tests.test_compile import build as build_layer_model


def build(mode: str, block_size: int, compile: str = "off", backend="inductor", **extra):
    """``test_compile``'s tiny model without dropout; ``compile: chunk`` compiles its runs
    with ``backend``."""
    chosen = {"runtime.compile_backend": backend, **extra}
    return build_layer_model(mode, block_size, compile, dropout=0.0, **chosen)


def test_chunk_choice_is_named():
    cfg = load_config(None, ["runtime.compile=chunk"])
    choice = select_runtime(cfg.runtime)
    assert choice.compiled and choice.chunked
    assert "compile=chunk (set in config; torch.compile per run" in choice.describe()


@pytest.mark.parametrize("dropout", ["model.hidden_dropout", "model.attention_dropout"])
def test_chunk_refuses_dropout(dropout):
    with pytest.raises(ConfigError, match=r"runtime\.compile.*'chunk'.*runtime\.compile=layer"):
        load_config(None, ["runtime.compile=chunk", f"{dropout}=0.1"])


def test_a_run_traces_as_one_graph():
    """The whole model's three layers: one graph, no break, every layer's matmuls in it."""
    model = build("block", 4, compile="chunk", backend="aot_eager")
    leader = model.layers[0]
    assert [run.layers for run in model.runs] == [list(model.layers)]
    state = model.embedding(window()[:, :-1])
    ctx = sequence_context(leader.layer.config, state.store[0], leader.rotary_base)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(state_region(model.runs[0].sublayers))(state, ctx)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    linears = sum(code.count("linear") for code in (g.code for g in explained.graphs))
    assert linears >= 3 * 4  # qkv, proj, fc1, fc2 of each of the three layers


@pytest.mark.parametrize(("recompute", "graphs"), [("none", 2), ("full", 3)])
def test_one_compile_per_run(recompute, graphs):
    """First step: a graph per run and the final aggregation's (full recompute, interval 2:
    runs of 2 and 1 layers); a second step compiles nothing more."""
    extra = {"parallel.recompute": recompute, "parallel.recompute_interval": 2}
    model = build("block", 4, compile="chunk", backend="aot_eager", **extra)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    loss_and_grads(model, steps=2)
    assert counters["stats"]["unique_graphs"] == graphs
    loss_and_grads(model, steps=2)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize(("mode", "block_size"), MODES)
def test_inductor_chunk_matches_eager(mode, block_size):
    torch._dynamo.reset()
    compiled = build(mode, block_size, compile="chunk")
    eager = build(mode, block_size)
    assert_same_numbers(compiled, eager, steps=2)
    with torch.no_grad():  # evaluation: another graph per run (no grad)
        evaluated = compiled.eval().loss(window(1))
        torch.testing.assert_close(evaluated, eager.eval().loss(window(1)), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("mode", "block_size", "recompute"),
    [
        ("block", 4, "attnres"),
        ("full", 1, "attnres"),
        ("block", 4, "full"),
        ("delta_block", 4, "attnres"),
        ("delta_full", 1, "full"),
    ],
)
def test_recompute_with_chunks_matches_eager(mode, block_size, recompute):
    """``attnres`` recompute checkpoints inside the run; ``full`` (interval 2) checkpoints each
    group around its run: the same numbers as eager without recompute."""
    extra = {"parallel.recompute": recompute, "parallel.recompute_interval": 2}
    torch._dynamo.reset()
    compiled = build(mode, block_size, compile="chunk", backend="aot_eager", **extra)
    assert_same_numbers(compiled, build(mode, block_size), steps=2)


# the pipeline case of tests/test_compile.py without dropout (which chunk refuses)
PIPELINE = {"model.attnres.impl": "twophase", "runtime.fused_norm": "off", "train.steps": 4}
CASES = {
    "pp1": ({}, "inductor"),
    "pp2": ({"pp": 2}, "aot_eager"),
    "tp2": ({"tp": 2}, "aot_eager"),
    "pp1_full_recompute": ({"parallel.recompute": "full"}, "aot_eager"),
}


@pytest.fixture(scope="module")
def eager_reference(small_dataset, tmp_path_factory):
    return single_process_reference(small_dataset, tmp_path_factory.mktemp("eager"), **PIPELINE)


@pytest.mark.parametrize("case", CASES)
def test_engine_chunk_matches_eager(case, eager_reference, small_dataset, tmp_path):
    """DeepSpeed's engine (torchrun), each stage's layers one compiled run (at full recompute
    with interval 2, each group), against the eager single-process run: the losses of 4
    optimizer steps and every parameter after them within 1e-5."""
    extra, backend = CASES[case]
    args = overrides(small_dataset, "block", str(tmp_path / case), **PIPELINE, **extra)
    args = [*args, "runtime.compile=chunk", f"runtime.compile_backend={backend}"]
    if "parallel.recompute" in extra:
        args.append("parallel.recompute_interval=2")
    nproc = extra.get("pp", 1) * extra.get("tp", 1)
    result = train_case(tmp_path, case, args, nproc=nproc)
    assert_matches(result, eager_reference, f"compile chunk {case} block")


def test_models_in_one_process_run_their_own_graphs():
    """Three chunk-compiled models (baseline, Block, Full) in one process, their training
    steps interleaved, from the third on under the steady stance, which checks only the
    guards telling one code object's cache entries apart: each region has its own code object
    (``compiled_region._own_code``), so no model runs another's graph. 4 steps each, against
    each model's eager twin within 1e-5."""
    torch._dynamo.reset()
    losses = {}
    for compile in ("chunk", "off"):
        engines = {}
        for mode, block_size in MODES:
            model = build(mode, block_size, compile=compile, backend="aot_eager")
            engines[mode] = LocalEngine(model, OptimConfig(lr=1e-2, warmup_steps=0), 10)
        for step in range(4):
            for mode, engine in engines.items():
                losses.setdefault((compile, mode), []).append(engine.train_step([window(step)]))
        if compile == "chunk":
            assert all(engine.guards.steady for engine in engines.values())
    for mode, _ in MODES:
        got, want = torch.tensor(losses["chunk", mode]), torch.tensor(losses["off", mode])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=mode)
