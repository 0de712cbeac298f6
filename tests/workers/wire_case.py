"""Train one configuration and record every tensor the engine hands to its p2p operations.

    torchrun ... tests/workers/wire_case.py OUT_DIR key=value ...

The virtual-stage engines queue each send and receive through ``_queue_p2p(op, tensors, peer)``
(DeepSpeed's ``DualPipeVEngine`` form, launched by ``CommitP2P``); wrapping it on the engine
instance sees every payload with its exact shape. Each rank writes ``OUT_DIR/rank{r}.json``:
``{"rank", "stage", "steps", "ops": [[op, peer stage, [shape, ...], itemsize], ...]}``.
"""

import json
import sys
from pathlib import Path

from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    engine = trainer.engine.engine
    ops = []
    queue = engine._queue_p2p

    def recording(op, tensors, stage):
        shapes = [list(t.shape) for t in tensors]
        ops.append([op.__name__, int(stage), shapes, tensors[0].element_size()])
        return queue(op, tensors, stage)

    engine._queue_p2p = recording
    trainer.train()
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": engine.global_rank, "stage": engine.stage_id, "steps": cfg.train.steps}
    (out / f"rank{engine.global_rank}.json").write_text(json.dumps(record | {"ops": ops}))
    shutdown_distributed()


if __name__ == "__main__":
    main()
