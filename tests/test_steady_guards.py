"""Steady guards (``runtime.guards``): training steps that skip the guards telling nothing apart.

A compiled run's training steps evaluate every TorchDynamo guard until one step has compiled
nothing; from then on only the guards that tell cache entries apart, until something compiles
again (``model/compiled_region.py``, ``SteadyGuards``). The reference is the same compiled run
with every guard on every step (``runtime.guards: full``), and the eager run of the same ops:

* the single-process engine, Block with an uneven last block, hidden and attention dropout on,
  without recompute and with full-layer recompute, an evaluation between steps 3 and 4 (its
  first pass compiles the eval-mode entries), a diagnostics step (its layers run eagerly): the
  stance of each step is the rule's, and the losses and final parameters equal the
  every-guard run's bitwise and the eager run's within 1e-5;
* DeepSpeed's pipeline engine at pp = 1 (bf16, the CPU proxy's step): the losses and the fp32
  master weights of 5 steps equal the every-guard run's bitwise.
* ``runtime.guards: steady`` without compiled layers is refused, naming the field; the
  ``runtime:`` line names the choice.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from attnres_dist.config import RuntimeConfig, load_config
from attnres_dist.diagnostics.collector import Diagnostics
from attnres_dist.errors import ConfigError
from attnres_dist.model import dropout_streams
from attnres_dist.model.gpt import ModelBuilder
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed
from attnres_dist.runtime.select import select_runtime
from attnres_dist.train.local_engine import LocalEngine
from tests.tiny_model import VOCAB, build_selected, randomize_mixers, tiny_overrides

STEPS = 6
EVAL_AFTER = 3  # an evaluation between steps 3 and 4
MEASURED = 5  # step 5 carries the diagnostics probe
# step 1 compiles; step 2 (every guard) compiles nothing; the evaluation compiles eval entries,
# so step 4 checks every guard again; the measured step compiles nothing (eager layers)
EXPECTED_STANCE = [False, False, True, False, True, True]


@pytest.fixture(scope="module")
def launch():
    return init_distributed(ParallelDims(), seed=0, device="cpu")


def _words(guards: str, compile: str = "layer", recompute: str = "none") -> dict:
    return {
        "parallel.recompute": recompute,
        "runtime.compile": compile,
        "runtime.compile_backend": "aot_eager",
        "runtime.guards": guards if compile == "layer" else "auto",
        "model.attnres.impl": "twophase",
        "runtime.fused_norm": "off",
        "model.hidden_dropout": 0.1,
        "model.attention_dropout": 0.1,
    }


def _window(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(step))


def local_run(guards: str, tmp_path, compile: str = "layer", recompute: str = "none"):
    """(stance before each step, losses, final parameters) of the single-process engine."""
    torch._dynamo.reset()
    words = _words(guards, compile, recompute)
    cfg = load_config(None, tiny_overrides("block", 4, 3, **words))
    model = build_selected(cfg)
    randomize_mixers(model)
    engine = LocalEngine(model, cfg.optim, STEPS)
    diagnostics = Diagnostics(MEASURED, engine, model.plan, run_dir=tmp_path / guards)
    stance, losses = [], []
    for step in range(1, STEPS + 1):
        stance.append(engine.guards.steady)
        dropout_streams.begin_step(seed=7, step=step)
        try:
            with diagnostics.step(step):
                losses.append(engine.train_step([_window(step), _window(100 + step)]))
        finally:
            dropout_streams.end()
        if step == EVAL_AFTER:
            engine.eval_loss([_window(-1)])
    diagnostics.close()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return stance, torch.stack(losses), params


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_single_process_steady_steps_equal_every_guard_steps(launch, tmp_path, recompute):
    """``recompute: full``: each layer's region runs without gradients in forward and again
    with them in backward, two cache entries told apart by the grad mode."""
    stance, losses, params = local_run("steady", tmp_path, recompute=recompute)
    full_stance, full_losses, full_params = local_run("full", tmp_path, recompute=recompute)
    _, eager_losses, eager_params = local_run("full", tmp_path, "off", recompute)
    assert stance == EXPECTED_STANCE
    assert not any(full_stance)
    assert torch.equal(losses, full_losses)
    torch.testing.assert_close(losses, eager_losses, rtol=0, atol=1e-5)
    for name, p in params.items():
        assert torch.equal(p, full_params[name]), name
        torch.testing.assert_close(p, eager_params[name], rtol=0, atol=1e-5, msg=name)
    assert (tmp_path / "steady" / "diagnostics.jsonl").read_text().count('"measure"') == 1


def pipeline_run(launch, guards: str):
    """(stance before each step, losses, fp32 master weights) of DeepSpeed's engine at pp = 1."""
    from attnres_dist.pipeline.engine import PipelineEngine
    from bench.host_bench import CONFIG, STEP

    torch._dynamo.reset()
    words = [f"{k}={v}" for k, v in _words(guards).items()]
    shape = ["model.num_layers=3", "model.hidden_size=32", "model.num_attention_heads=4"]
    cfg = load_config(
        CONFIG, [*shape, *STEP, "model.seq_length=12", "optim.warmup_steps=1", *words]
    )
    runtime = select_runtime(cfg.runtime, cfg.model.attnres.impl)
    engine = PipelineEngine(
        cfg, ModelBuilder(cfg.model, VOCAB, seed=0, runtime=runtime), ParallelDims(), launch
    )
    stance, losses = [], []
    for step in range(1, 6):
        stance.append(engine.guards.steady)
        dropout_streams.begin_step(seed=7, step=step)
        try:
            losses.append(engine.train_step([_window(step)[:1]]).float())
        finally:
            dropout_streams.end()
    masters = [engine.sharded_state.master(p).clone() for _, p, _ in engine.checkpoint_params()]
    return stance, torch.stack(losses), masters


def test_pipeline_engine_steady_steps_equal_every_guard_steps(launch):
    stance, losses, masters = pipeline_run(launch, "steady")
    full_stance, full_losses, full_masters = pipeline_run(launch, "full")
    assert stance == [False, False, True, True, True]
    assert not any(full_stance)
    assert torch.equal(losses, full_losses)
    for mine, theirs in zip(masters, full_masters, strict=True):
        assert torch.equal(mine, theirs)


def test_steady_needs_compiled_layers():
    with pytest.raises(ConfigError, match=r"runtime\.guards.*runtime\.compile=layer"):
        load_config(None, tiny_overrides("block", 4, 3, **{"runtime.guards": "steady"}))


def test_the_runtime_line_names_the_guards():
    """``auto`` takes steady guards with compiled layers, ``full`` is honoured, and an eager run
    has no guard choice at all (nothing is compiled)."""
    compiled = select_runtime(RuntimeConfig(compile="layer"))
    assert compiled.steady_guards and "guards=steady (auto: " in compiled.describe()
    full = select_runtime(RuntimeConfig(compile="layer", guards="full"))
    assert not full.steady_guards and "guards=full (set in config" in full.describe()
    eager = select_runtime(RuntimeConfig())
    assert eager.guards is None and not eager.steady_guards and "guards=" not in eager.describe()
