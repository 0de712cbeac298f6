"""Two bf16 engines on the same ranks, one with this trainer's bookkeeping
(``pipeline/bf16_bookkeeping.py``) and one with DeepSpeed's own ``BF16_Optimizer`` methods,
stepped on the same batches; every rank checks that they stay bitwise equal.

    torchrun --nproc_per_node=N tests/workers/bf16_bookkeeping_case.py PP TP CLIP key=value ...

Checked each step: the loss, the gradient norm before clipping (DeepSpeed's count-once norm,
summed over the model-parallel group: stages and tensor ranks), the LR and the count of skipped
steps; after the last step, the fp32 master weight of every parameter this rank holds. On step
``SKIP`` rank 0 alone gets a non-finite gradient: every rank must skip that step. Prints
``ok <rank> <norms>``.
"""

import sys

import torch

SKIP = 2  # the 0-based step whose gradient rank 0 makes non-finite


def main() -> None:
    from attnres_dist.config import load_config
    from attnres_dist.model.gpt import ModelBuilder
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed, shutdown_distributed
    from attnres_dist.pipeline.engine import PipelineEngine
    from attnres_dist.runtime import select_runtime

    pp, tp, clip = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    words = [f"parallel.pp={pp}", f"parallel.tp={tp}", f"optim.grad_clip={clip}", *sys.argv[4:]]
    cfg = load_config(None, words)
    dims = ParallelDims(pp=pp, tp=tp)
    launch = init_distributed(dims, seed=0, device="cpu")
    runtime = select_runtime(cfg.runtime, cfg.model.attnres.impl)

    def engine():
        builder = ModelBuilder(cfg.model, 257, seed=0, runtime=runtime)
        return PipelineEngine(cfg, builder, dims, launch)

    ours, theirs = engine(), engine()
    assert ours.bookkeeping.deferred is not None, "the skip is not decided on the device"
    opt = theirs.engine.optimizer
    assert {"step", "update_hp_grads", "clear_hp_grads"} <= set(vars(opt)), (
        "the bookkeeping was not installed"
    )
    del opt.step, opt.update_hp_grads, opt.clear_hp_grads  # DeepSpeed's own methods again
    g = torch.Generator().manual_seed(0)
    seq, micro = cfg.model.seq_length, cfg.train.global_batch_size // cfg.train.micro_batch_size
    norms = []
    for step in range(4):
        batch = [
            torch.randint(0, 257, (cfg.train.micro_batch_size, seq + 1), generator=g)
            for _ in range(micro)
        ]
        hooks = []
        if step == SKIP and launch.rank == 0:
            for engine in (ours, theirs):
                param = next(engine.module.parameters())
                hooks.append(param.register_hook(lambda grad: torch.full_like(grad, float("inf"))))
        a, b = ours.train_step(batch), theirs.train_step(batch)
        for hook in hooks:
            hook.remove()
        assert torch.equal(a, b), (step, a, b)
        norm_ours, norm_theirs = ours.last_grad_norm, theirs.last_grad_norm
        assert norm_ours == norm_theirs, (step, norm_ours, norm_theirs)
        assert ours.lr == theirs.lr, (step, ours.lr, theirs.lr)
        assert ours.engine.skipped_steps == theirs.engine.skipped_steps == int(step >= SKIP)
        norms.append(norm_ours)
    pairs = zip(ours.checkpoint_params(), theirs.checkpoint_params(), strict=True)
    for (name, p, _), (_, q, _) in pairs:
        assert torch.equal(ours.sharded_state.master(p), theirs.sharded_state.master(q)), name
    # one write of the whole line: print() writes its parts one by one, and under an
    # unbuffered stdout the four ranks' parts then interleave in torchrun's merged output
    line = " ".join(["ok", str(launch.rank), *(f"{n:.6g}" for n in norms)])
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    shutdown_distributed()


if __name__ == "__main__":
    main()
