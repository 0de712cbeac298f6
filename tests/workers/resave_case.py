"""Resume a checkpoint in this layout and save it again at once, without training.

    python tests/workers/resave_case.py key=value ...   (checkpoint.resume = the one to load,
                                                         checkpoint.dir = where to save)
Comparing the two checkpoints tensor by tensor shows what the load restored: parameters (the
fp32 master weights under DeepSpeed's bf16 engine) and AdamW state, by canonical name.
"""

import sys

from attnres_dist.config import load_config
from attnres_dist.parallel.process_groups import shutdown_distributed
from attnres_dist.train.trainer import Trainer


def main() -> None:
    trainer = Trainer(load_config(None, sys.argv[1:]))
    trainer.checkpoints.save(trainer.start_step, trainer.engine, trainer.dims, trainer.launch.rank)
    shutdown_distributed()


if __name__ == "__main__":
    main()
