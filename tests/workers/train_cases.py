"""Train several configurations in one launch, one after the other, and save each one's result.

    python tests/workers/train_cases.py OUT_DIR CASES.json [--wire]     (or under torchrun)

``CASES.json`` maps a case name to its dotted overrides; every case's world is the launch's.
Rank 0 writes ``OUT_DIR/<name>.pt``: ``{"losses": [...], "params": {canonical name: full
tensor}, "valid": loss}``. With ``--wire``, every rank also records each tensor its
virtual-stage engine queues for a p2p operation (``_queue_p2p(op, tensors, peer)``, DeepSpeed's
``DualPipeVEngine`` form, launched by ``CommitP2P``; wrapped on the engine instance, it sees
every payload with its exact shape) and writes ``OUT_DIR/<name>.rank<r>.json``: ``{"rank",
"stage", "steps", "train": OPS, "eval": OPS}``, OPS = ``[[op, peer stage, [shape, ...],
itemsize], ...]`` of the training steps (``train_batch``) and of everything else.

Between cases the model-parallel groups are torn down (the default group stays: the launch's
start-up is paid once) and Dynamo's caches are cleared, so each case builds, and compiles, from
nothing. A case that raises writes its traceback to ``OUT_DIR/<name>.error.<rank>`` on each
rank that raised, and ends the launch: the cases after it are not run, and say so.
"""

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed import comm as ds_comm

from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer


def record_p2p(engine) -> dict[str, list]:
    """Wrap ``engine``'s p2p queue and training step: the ops each one queues, filled as it runs."""
    ops = {"train": [], "eval": []}
    current = ["eval"]
    queue, train_batch = engine._queue_p2p, engine.train_batch
    names = {ds_comm.isend: "isend", ds_comm.irecv: "irecv"}

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
    return ops


def run_case(overrides: list[str], out_dir: Path, name: str, wire: bool) -> None:
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    engine = trainer.engine.engine if wire else None  # a pipeline engine's DeepSpeed engine
    ops = record_p2p(engine) if wire else None
    summary = trainer.train()
    state = trainer.engine.full_state()
    if state is not None:
        result = {"losses": summary["train_losses"], "params": state}
        torch.save(result | {"valid": summary["final_valid_loss"]}, out_dir / f"{name}.pt")
    if ops is not None:
        record = {"rank": engine.global_rank, "stage": engine.stage_id, "steps": cfg.train.steps}
        (out_dir / f"{name}.rank{engine.global_rank}.json").write_text(json.dumps(record | ops))


def between_cases() -> None:
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    torch._dynamo.reset()


def main() -> None:
    out_dir, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    wire = "--wire" in sys.argv[3:]
    for name, overrides in cases.items():
        try:
            run_case(overrides, out_dir, name, wire)
        except BaseException:
            rank = dist.get_rank() if dist.is_initialized() else 0
            (out_dir / f"{name}.error.{rank}").write_text(traceback.format_exc())
            raise
        between_cases()
    shutdown_distributed()


if __name__ == "__main__":
    main()
