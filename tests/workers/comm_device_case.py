"""Train a tiny model under ``CommDeviceCheck`` and write what it checked (one file per rank).

    torchrun --nproc_per_node=2 tests/workers/comm_device_case.py OUT_PREFIX key=value ...

The check is installed before anything else is imported, so no code can hold an unchecked
torch.distributed function. The run covers: the trainer (parameter count), DeepSpeed's pipeline
p2p and gradient reductions, the global-norm clip, diagnostics (every step), a checkpoint save,
``full_state``; with pp >= 2 also the profiler's link calibration and the pipeline benchmark's
step-time reduction. Rank r writes ``OUT_PREFIX.r.json`` with ``CommDeviceCheck.report()``.
"""

import json
import sys

from attnres_dist.parallel.comm_check import CommDeviceCheck

CHECK = CommDeviceCheck("cpu")  # the run's device here; the taint plays the default device
CHECK.install()

import torch.distributed as dist  # noqa: E402

from attnres_dist.config import load_config  # noqa: E402
from attnres_dist.parallel.comm_device import comm_device  # noqa: E402
from attnres_dist.parallel.process_groups import shutdown_distributed  # noqa: E402
from attnres_dist.train.trainer import Trainer  # noqa: E402


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    trainer = Trainer(load_config(None, overrides))
    trainer.train()
    trainer.engine.full_state()
    if trainer.dims.pp >= 2:
        from attnres_dist.pipeline.contract import boundary_specs_for_config
        from attnres_dist.profile.calibrate import calibrate_links
        from bench.launch_job import slowest_rank_seconds

        specs = boundary_specs_for_config(trainer.cfg, trainer.builder.vocab_size)
        sizes = {s.sender: s.bytes_forward for s in specs}
        calibrate_links(trainer.dims, trainer.launch.rank, sizes, reps=2, warmup=1)
        slowest_rank_seconds(0.5)
    report = CHECK.report() | {"comm_device": str(comm_device()), "rank": dist.get_rank()}
    shutdown_distributed()
    with open(f"{out}.{report['rank']}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
