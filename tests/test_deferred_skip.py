"""The bf16 optimizer's skip of a non-finite step, decided on the device (``deferred_skip.py``).

* Against DeepSpeed's own ``BF16_Optimizer`` (which reads the norm on the host every step),
  over 6 steps with non-finite gradients at steps 3 and 4: bitwise the same losses, gradient
  norms (inf on the skipped steps) and fp32 master weights, the same LR after every step
  (the schedule not advanced by a skip) and the same count of skipped steps; with the clip
  taking effect and not.
* The step reads no tensor on the host: none of ``item``, ``bool``, ``float``, ``int``,
  ``tolist``, ``__index__`` on any tensor but the host copy of the last step's flag, over steps
  with and without a skip; DeepSpeed's own step, seen the same way, reads its norm each step.
* ``step_back`` is the ``LambdaLR`` of one step fewer; ``deferrable`` only with torch's fused
  Adam(W) and a ``LambdaLR``.
"""

from __future__ import annotations

import pytest
import torch

from bench.host_reads import HostReads
from tests.test_host_work import _engine, deepspeeds_own

SKIPPED = (2, 3)  # 0-based steps whose gradients are made non-finite
WORDS = ("train.steps=8", "optim.warmup_steps=2")  # an LR that moves every step


@pytest.fixture(scope="module")
def launch():
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    return init_distributed(ParallelDims(), seed=0, device="cpu")


def _non_finite_gradient(engine):
    """A hook making one parameter's gradient infinite (the parameters stay as they are)."""
    param = next(engine.module.parameters())
    return param.register_hook(lambda grad: torch.full_like(grad, float("inf")))


def _step(engine, micro, skip: bool):
    hook = _non_finite_gradient(engine) if skip else None
    loss = engine.train_step(micro)
    if hook is not None:
        hook.remove()
    return loss


@pytest.mark.parametrize("clip", [0.05, 1e3])
def test_deferred_skip_gives_deepspeeds_steps(launch, clip):
    ours = _engine(launch, "bf16", f"optim.grad_clip={clip}", *WORDS)
    theirs = deepspeeds_own(_engine(launch, "bf16", f"optim.grad_clip={clip}", *WORDS))
    assert ours.bookkeeping.deferred is not None  # the path under test is the device's skip
    g = torch.Generator().manual_seed(0)
    lrs = []
    for step in range(6):
        micro = [torch.randint(0, 257, (1, 9), generator=g) for _ in range(2)]
        skip = step in SKIPPED
        loss_ours, loss_theirs = _step(ours, micro, skip), _step(theirs, micro, skip)
        assert torch.equal(loss_ours, loss_theirs), step  # the loss is before the update
        norm_ours, norm_theirs = ours.last_grad_norm, theirs.last_grad_norm
        assert norm_ours == norm_theirs, (step, norm_ours, norm_theirs)
        assert (norm_ours == float("inf")) == skip, (step, norm_ours)
        assert ours.lr == theirs.lr, (step, ours.lr, theirs.lr)
        lrs.append(ours.lr)
        skipped = sum(s <= step for s in SKIPPED)
        assert ours.engine.skipped_steps == theirs.engine.skipped_steps == skipped, step
    assert lrs[1] == lrs[2] == lrs[3] != lrs[4]  # a skip leaves the schedule where it was
    pairs = zip(ours.checkpoint_params(), theirs.checkpoint_params(), strict=True)
    for (name, a, _), (_, b, _) in pairs:
        assert torch.equal(ours.sharded_state.master(a), theirs.sharded_state.master(b)), name
    assert ours.scheduler.state_dict() == theirs.scheduler.state_dict()


def test_the_step_reads_nothing_on_the_host(launch):
    ours = _engine(launch, "bf16", *WORDS)
    theirs = deepspeeds_own(_engine(launch, "bf16", *WORDS))
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(0, 257, (1, 9), generator=g) for _ in range(2)] for _ in range(4)]
    for micro in batches[:1]:  # a first step: lazy state, DeepSpeed's first-step work
        ours.train_step(micro), theirs.train_step(micro)
    seen = {}
    for name, engine in (("ours", ours), ("theirs", theirs)):
        deferred = engine.bookkeeping.deferred if name == "ours" else None
        with HostReads(None if deferred is None else deferred.host) as mode:
            for step, micro in enumerate(batches[1:], start=1):
                _step(engine, micro, skip=step == 2)
        seen[name] = mode.reads
    assert seen["ours"] == {}, seen["ours"]
    assert seen["theirs"]["__bool__"] >= 3  # DeepSpeed's is_invalid_grad_norm, once a step
    assert ours.engine.skipped_steps == theirs.engine.skipped_steps == 1  # read here, after


def test_step_back_is_the_schedule_of_one_step_fewer():
    from attnres_dist.pipeline.deferred_skip import step_back

    def schedule():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s * s))

    for k in (1, 2, 5):
        opt_a, a = schedule()
        opt_b, b = schedule()
        for _ in range(k):
            opt_a.step(), a.step()
        for _ in range(k - 1):
            opt_b.step(), b.step()
        step_back(a)
        assert a.last_epoch == b.last_epoch == k - 1
        assert (
            opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == 0.3 / (1 + (k - 1) ** 2)
        )
        assert a.state_dict() == b.state_dict()


def test_deferrable_only_with_fused_adamw_and_lambdalr():
    from attnres_dist.pipeline.deferred_skip import deferrable

    p = [torch.nn.Parameter(torch.zeros(2))]
    fused, looped = torch.optim.AdamW(p, fused=True), torch.optim.AdamW(p, foreach=False)
    lam = torch.optim.lr_scheduler.LambdaLR(fused, lambda s: 1.0)
    step = torch.optim.lr_scheduler.StepLR(fused, 2)
    assert deferrable(fused, lam)
    assert not deferrable(looped, lam)  # torch's loops take no found_inf
    assert not deferrable(fused, step)  # a chained schedule cannot go back exactly
    assert not deferrable(torch.optim.SGD(p, lr=0.1), lam)


def test_found_inf_leaves_fused_adamw_as_it_was():
    """torch's fused AdamW at ``found_inf`` 1: parameters, moments and step counts unchanged
    (what the deferred skip relies on); at 0: the same update as without the flag."""
    from attnres_dist.pipeline.deferred_skip import DeferredSkip

    def stepped(norm: float | None):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5))
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        p.grad = torch.randn(5)
        opt.step()  # a first step, so there are moments to keep
        before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
        p.grad = torch.randn(5)
        skip = DeferredSkip(torch.device("cpu"))
        if norm is not None:
            opt.found_inf = skip.found_inf(torch.tensor(norm))
        opt.step()
        return before, (p.detach(), opt.state[p]), skip.settle()

    (p0, s0), (p1, s1), skipped = stepped(float("nan"))
    assert skipped and torch.equal(p0, p1)
    assert all(torch.equal(s0[k], s1[k]) for k in s0)
    _, (p_plain, s_plain), _ = stepped(None)
    _, (p_flag, s_flag), skipped = stepped(2.0)
    assert not skipped and torch.equal(p_plain, p_flag) and not torch.equal(p_flag, p0)
    assert all(torch.equal(s_plain[k], s_flag[k]) for k in s_plain)


@pytest.mark.cuda
def test_found_inf_does_not_wait_for_the_gpu():
    from attnres_dist.pipeline.deferred_skip import DeferredSkip

    skip = DeferredSkip(torch.device("cuda"))
    norm = torch.tensor(float("inf"), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a wait for the device raises
    try:
        flag = skip.found_inf(norm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert flag.is_cuda and skip.settle()
