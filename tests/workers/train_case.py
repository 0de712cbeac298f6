"""Train one configuration and save its per-step losses and full parameters.

Run as a single process (the reference) or under torchrun (any pp x dp x tp layout):
    python tests/workers/train_case.py OUT.pt key=value ...
Rank 0 writes ``{"losses": [...], "params": {canonical name: full tensor}, "valid": loss}``.
"""

import sys

import torch

from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    trainer = Trainer(load_config(None, overrides))
    summary = trainer.train()
    state = trainer.engine.full_state()
    if state is not None:
        result = {"losses": summary["train_losses"], "params": state}
        torch.save(result | {"valid": summary["final_valid_loss"]}, out)
    shutdown_distributed()


if __name__ == "__main__":
    main()
