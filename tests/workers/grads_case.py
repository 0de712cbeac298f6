"""Train one configuration and save every step's gradients, before clipping, by canonical name.

Run as a single process or under torchrun (tp = 1, dp = 1 layouts):
    python tests/workers/grads_case.py OUT.pt key=value ...
A step pre-hook on the optimizer copies each owned parameter's accumulated gradient (after
DeepSpeed's data-parallel and tied reductions); rank 0 writes ``[{name: grad} per step]``.
"""

import sys

import torch
import torch.distributed as dist

from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    trainer = Trainer(load_config(None, overrides))
    engine = trainer.engine
    owned = [(name, p) for name, p, mine in engine.checkpoint_params() if mine]
    steps: list[dict[str, torch.Tensor]] = []

    def capture(optimizer, args, kwargs):
        steps.append({name: p.grad.detach().clone() for name, p in owned if p.grad is not None})

    engine.optimizer.register_step_pre_hook(capture)
    trainer.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(steps, gathered, dst=0)
        if dist.get_rank() == 0:
            steps = [
                {k: v for part in parts for k, v in part.items()}
                for parts in zip(*gathered, strict=True)
            ]
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(steps, out)
    shutdown_distributed()


if __name__ == "__main__":
    main()
