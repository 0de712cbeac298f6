"""Host work of a training step, removed where it does nothing, without changing the numbers.

* At dp = 1 DeepSpeed's ``ReduceGrads`` (an all-reduce over one rank) is skipped: DeepSpeed's
  own reduction never runs, and 3 steps of the bf16 engine (and of fp32 ZeRO-0) give
  bitwise the losses and parameters of an identical engine that runs DeepSpeed's reduction
  with fp32 communication; at dp = 2 and under fp32 ZeRO-1 the handler is DeepSpeed's.
* DeepSpeed's bf16 optimizer bookkeeping (``pipeline/bf16_bookkeeping.py``) gives bitwise
  DeepSpeed's own steps: losses, gradient norms and fp32 master weights over 4 steps, with the
  clip taking effect and not, the last step skipped for a non-finite norm; and at pp = 2 x
  tp = 2 (4 ranks) the norm summed over stages and tensor ranks and every rank's master weights.
* ``train()`` on a pipeline module in its mode already leaves every submodule as it is, and
  still sets a submodule that was put in the other mode.
* The trainer's losses are tensors until read: ``train_step`` returns a 0-d tensor.
* Batches reach the device through ``to_device`` (pinned, queued copies on a GPU; the GPU test
  checks the copy neither waits for the device nor changes a value).
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.data.device_copy import to_device
from tests.conftest import run_job

SHAPE = (
    "model.num_layers=3",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=8",
    "model.attnres.block_size=2",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
)


@pytest.fixture(scope="module")
def launch():
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    return init_distributed(ParallelDims(), seed=0, device="cpu")


def _engine(launch, dtype: str, *extra: str):
    from attnres_dist.config import load_config
    from attnres_dist.model.gpt import ModelBuilder
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.pipeline.engine import PipelineEngine
    from attnres_dist.runtime import select_runtime
    from bench.host_bench import CONFIG, STEP, VOCAB

    words = [*SHAPE, *STEP, f"runtime.dtype={dtype}", "train.global_batch_size=2", *extra]
    cfg = load_config(CONFIG, words)
    runtime = select_runtime(cfg.runtime, cfg.model.attnres.impl)
    builder = ModelBuilder(cfg.model, VOCAB, seed=0, runtime=runtime)
    return PipelineEngine(cfg, builder, ParallelDims(), launch)


def deepspeeds_own(engine):
    """``engine`` with DeepSpeed's own bf16 optimizer methods again (no bookkeeping)."""
    opt = engine.engine.optimizer
    assert {"step", "update_hp_grads", "clear_hp_grads"} <= set(vars(opt)), (
        "the bookkeeping was not installed"
    )
    del opt.step, opt.update_hp_grads, opt.clear_hp_grads
    return engine


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_single_replica_skips_reduction_with_the_same_parameters(launch, dtype, monkeypatch):
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine as DeepSpeedPipe

    skipping, reducing = _engine(launch, dtype), _engine(launch, dtype)
    original = DeepSpeedPipe._INSTRUCTION_MAP[schedule.ReduceGrads]
    assert skipping.engine._INSTRUCTION_MAP[schedule.ReduceGrads] is not original
    reducing.engine._INSTRUCTION_MAP[schedule.ReduceGrads] = original
    # DeepSpeed communicates bf16 gradients by default: at dp = 1 its reduction rounds the fp32
    # accumulated gradients to bf16 and back (single_replica.py). In fp32 it is the identity
    # that the skip must equal.
    reducing.engine.communication_data_type = torch.float32
    calls = {id(skipping.engine): 0, id(reducing.engine): 0}
    fallback = DeepSpeedPipe.buffered_allreduce_fallback

    def counted(self, *args, **kwargs):
        calls[id(self)] += 1
        return fallback(self, *args, **kwargs)

    monkeypatch.setattr(DeepSpeedPipe, "buffered_allreduce_fallback", counted)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        micro = [torch.randint(0, 257, (1, 9), generator=g) for _ in range(2)]
        loss_skip, loss_ds = skipping.train_step(micro), reducing.train_step(micro)
        assert isinstance(loss_skip, torch.Tensor) and torch.equal(loss_skip, loss_ds)
    assert calls == {id(skipping.engine): 0, id(reducing.engine): 3}
    pairs = zip(skipping.checkpoint_params(), reducing.checkpoint_params(), strict=True)
    for (name, a, _), (_, b, _) in pairs:
        if skipping.sharded_state is not None:  # bf16: the fp32 master weights
            a, b = skipping.sharded_state.master(a), reducing.sharded_state.master(b)
        assert torch.equal(a, b), name


@pytest.mark.parametrize("clip", [0.05, 1e3])
def test_bf16_bookkeeping_gives_deepspeeds_steps(launch, clip):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    ours = _engine(launch, "bf16", f"optim.grad_clip={clip}")
    theirs = deepspeeds_own(_engine(launch, "bf16", f"optim.grad_clip={clip}"))
    assert isinstance(theirs.engine.optimizer, BF16_Optimizer)
    g = torch.Generator().manual_seed(0)
    clipped = []
    for step in range(4):
        if step == 3:  # a non-finite gradient: DeepSpeed skips the step
            for engine in (ours, theirs):
                with torch.no_grad():
                    next(engine.module.parameters()).view(-1)[0] = float("nan")
        micro = [torch.randint(0, 257, (1, 9), generator=g) for _ in range(2)]
        loss_ours, loss_theirs = ours.train_step(micro), theirs.train_step(micro)
        assert torch.equal(loss_ours, loss_theirs) or step == 3
        norm_ours, norm_theirs = ours.last_grad_norm, theirs.last_grad_norm
        assert norm_ours == norm_theirs, (step, norm_ours, norm_theirs)
        clipped.append(norm_ours > clip)
    assert clipped == [clip < 1, clip < 1, clip < 1, True]  # the last: inf, skipped
    pairs = zip(ours.checkpoint_params(), theirs.checkpoint_params(), strict=True)
    for (name, a, _), (_, b, _) in pairs:
        assert torch.equal(ours.sharded_state.master(a), theirs.sharded_state.master(b)), name


def test_cleared_accumulators_read_as_deepspeeds_zeros(launch):
    """After a step DeepSpeed zeroes the fp32 accumulators; ours only marks them stale. The
    next accumulation (copy) must leave what DeepSpeed's (zero, then add) leaves, also for a
    parameter that got no gradient; and a step that got none at all must count zeros."""
    ours, theirs = _engine(launch, "bf16"), deepspeeds_own(_engine(launch, "bf16"))
    g = torch.Generator().manual_seed(0)
    micro = [torch.randint(0, 257, (1, 9), generator=g) for _ in range(2)]
    for engine in (ours, theirs):
        engine.train_step(micro)  # the accumulators now hold (clipped) gradients
    accumulators = ours.engine.optimizer.fp32_groups_gradients_flat
    assert any(bool(a.abs().sum() > 0) for a in accumulators)  # stale, not zeroed
    g.manual_seed(1)
    for engine in (ours, theirs):
        opt = engine.engine.optimizer
        for group in opt.bf16_groups:
            for k, p in enumerate(group):
                p.grad = None if k == 0 else torch.randn(p.shape, generator=g).to(p.dtype)
        g.manual_seed(1)
        opt.update_hp_grads()
    pairs = zip(accumulators, theirs.engine.optimizer.fp32_groups_gradients_flat, strict=True)
    for a, b in pairs:
        assert torch.equal(a, b)
    assert all(
        not bool(a[: ours.engine.optimizer.bf16_groups[i][0].numel()].any())
        for i, a in enumerate(accumulators)
    )  # no gradient: zero
    # a clear, then a step with no gradient at all (DeepSpeed's own cannot: its norm stacks
    # an empty list): the stale accumulators must count as zeros
    ours.engine.optimizer.clear_hp_grads()
    ours.engine.optimizer.step()
    assert float(ours.engine.optimizer._global_grad_norm) == 0.0


@pytest.mark.slow
def test_bf16_bookkeeping_gives_deepspeeds_steps_across_stages_and_tensor_ranks():
    """pp = 2 x tp = 2 (torchrun, 4 ranks; clip active): the norm DeepSpeed's rule counts once
    (the last stage's tied embedding copy skipped, replicated parameters on tensor rank 0 only)
    and sums over stages and tensor ranks, the LR and skip count after each step, and every
    rank's master weights after 4 steps, are bitwise DeepSpeed's own, with the third step's
    gradient made non-finite on rank 0 alone: every rank skips it, decided on the device
    (``tests/workers/bf16_bookkeeping_case.py``)."""
    words = [*SHAPE, "runtime.dtype=bf16", "model.attnres.mode=block", "model.num_layers=4"]
    words += ["train.micro_batch_size=1", "train.global_batch_size=2", "optim.warmup_steps=1"]
    words += ["train.steps=6"]
    proc = run_job(["tests/workers/bf16_bookkeeping_case.py", "2", "2", "0.05", *words], nproc=4)
    done = [line.split() for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert sorted(int(d[1]) for d in done) == [0, 1, 2, 3], proc.stdout
    norms = {tuple(d[2:]) for d in done}
    assert len(norms) == 1, norms  # every rank computed the same global norm
    norms = [float(n) for n in norms.pop()]
    assert norms[2] == float("inf")  # skipped on every rank
    assert all(0.05 < n < float("inf") for n in norms[:2] + norms[3:])  # the clip took effect


def test_train_sets_only_what_differs():
    from attnres_dist.pipeline.module import SteadyMode

    class Module(SteadyMode, torch.nn.Sequential):
        pass

    module = Module(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    assert module.train() is module and all(m.training for m in module.modules())
    module[1].eval()  # one submodule in the other mode: train() still reaches it
    module.train()
    assert all(m.training for m in module.modules())
    module.eval()
    assert not any(m.training for m in module.modules())


def test_reduction_kept_where_it_does_something():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine as DeepSpeedPipe

    from attnres_dist.pipeline.single_replica import skip_single_replica_reduction

    class Engine:  # what the skip reads and writes: the instruction map
        _INSTRUCTION_MAP = DeepSpeedPipe._INSTRUCTION_MAP

    for dp, zero1_fp32 in ((2, False), (1, True)):
        engine = Engine()
        assert not skip_single_replica_reduction(engine, dp, zero1_fp32)
        assert "_INSTRUCTION_MAP" not in vars(engine)
    engine = Engine()
    assert skip_single_replica_reduction(engine, 1, False)
    handlers = vars(engine)["_INSTRUCTION_MAP"]
    assert (
        handlers[schedule.ReduceGrads] is not DeepSpeedPipe._INSTRUCTION_MAP[schedule.ReduceGrads]
    )
    assert DeepSpeedPipe._INSTRUCTION_MAP[schedule.ReduceGrads] is DeepSpeedPipe._exec_reduce_grads
    others = set(handlers) - {schedule.ReduceGrads}
    assert all(handlers[k] is DeepSpeedPipe._INSTRUCTION_MAP[k] for k in others)


def test_to_device_on_cpu_is_the_tensor():
    t = torch.arange(6).view(2, 3)
    assert to_device(t, torch.device("cpu")) is t


@pytest.mark.cuda
def test_to_device_copies_to_gpu_without_waiting():
    t = torch.randint(0, 50_000, (8, 1025))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a copy that waits for the device raises
    try:
        on_gpu = to_device(t, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), t)
