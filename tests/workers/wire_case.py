"""Train one configuration, recording every tensor the engine hands to its p2p operations.

    torchrun ... tests/workers/wire_case.py OUT_DIR key=value ...

The virtual-stage engines queue each send and receive through ``_queue_p2p(op, tensors, peer)``
(DeepSpeed's ``DualPipeVEngine`` form, launched by ``CommitP2P``); wrapping it on the engine
instance sees every payload with its exact shape. Each rank writes ``OUT_DIR/rank{r}.json``:
``{"rank", "stage", "steps", "train": OPS, "eval": OPS}``, OPS = ``[[op, peer stage, [shape,
...], itemsize], ...]`` of the training steps (``train_batch``) and of everything else; rank 0
also writes ``OUT_DIR/result.pt`` as ``train_case.py`` does (losses, parameters, validation).
"""

import json
import sys
from pathlib import Path

import torch
from deepspeed import comm as dist

from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    engine = trainer.engine.engine
    ops = {"train": [], "eval": []}
    current = ["eval"]
    queue, train_batch = engine._queue_p2p, engine.train_batch
    names = {dist.isend: "isend", dist.irecv: "irecv"}

    def recording(op, tensors, stage):
        shapes = [list(t.shape) for t in tensors]
        name = names.get(op, getattr(op, "__name__", str(op)))
        ops[current[0]].append([name, int(stage), shapes, tensors[0].element_size()])
        return queue(op, tensors, stage)

    def training(*args, **kwargs):
        current[0] = "train"
        try:
            return train_batch(*args, **kwargs)
        finally:
            current[0] = "eval"

    engine._queue_p2p, engine.train_batch = recording, training
    summary = trainer.train()
    state = trainer.engine.full_state()
    out.mkdir(parents=True, exist_ok=True)
    if state is not None:
        result = {"losses": summary["train_losses"], "params": state}
        torch.save(result | {"valid": summary["final_valid_loss"]}, out / "result.pt")
    record = {"rank": engine.global_rank, "stage": engine.stage_id, "steps": cfg.train.steps}
    (out / f"rank{engine.global_rank}.json").write_text(json.dumps(record | ops))
    shutdown_distributed()


if __name__ == "__main__":
    main()
