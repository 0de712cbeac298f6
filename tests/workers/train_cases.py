"""Train several configurations in one launch, one after the other, and save each one's result.

    python tests/workers/train_cases.py OUT_DIR CASES.json      (or under torchrun)

``CASES.json`` maps a case name to its dotted overrides; every case's world is the launch's.
Rank 0 writes ``OUT_DIR/<name>.pt`` as ``train_case.py`` does (per-step losses, every
parameter by canonical name, the final validation loss). Between cases the model-parallel
groups are torn down (the default group stays: the launch's start-up is paid once) and
Dynamo's caches are cleared, so each case builds, and compiles, from nothing. A case that
raises writes its traceback to ``OUT_DIR/<name>.error.<rank>`` on each rank that raised, and
ends the launch: the cases after it are not run, and say so.
"""

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer


def run_case(overrides: list[str], out: Path) -> None:
    trainer = Trainer(load_config(None, overrides))
    summary = trainer.train()
    state = trainer.engine.full_state()
    if state is not None:
        result = {"losses": summary["train_losses"], "params": state}
        torch.save(result | {"valid": summary["final_valid_loss"]}, out)


def between_cases() -> None:
    from megatron.core import parallel_state

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    torch._dynamo.reset()


def main() -> None:
    out_dir, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for name, overrides in cases.items():
        try:
            run_case(overrides, out_dir / f"{name}.pt")
        except BaseException:
            rank = dist.get_rank() if dist.is_initialized() else 0
            (out_dir / f"{name}.error.{rank}").write_text(traceback.format_exc())
            raise
        between_cases()
    shutdown_distributed()


if __name__ == "__main__":
    main()
