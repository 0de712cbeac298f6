"""What the instrumentation costs: measured and plain steps interleaved, per variant.

    python -m studies.overhead [--config configs/study-cpu.yaml] [--steps 41]

Trains each variant for ``--steps`` steps in this process with ``metrics.every_k = 2``, so
measured and plain steps alternate and drifting machine load hits both alike, and prints the
median step times, their difference, and the time spent inside the instrumentation itself
(``Diagnostics.timing``). No evaluation and nothing kept: the run directories are temporary.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

VARIANTS = ("baseline", "block", "full", "delta_block", "delta_full")


def measure(config: str, variant: str, steps: int, overrides: list[str]) -> dict:
    from attnres_dist.config import load_config
    from attnres_dist.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="attnres-overhead-") as run_dir:
        cfg = load_config(
            config,
            [
                *overrides,
                f"model.attnres.mode={variant}",
                "metrics.every_k=2",
                f"output.run_dir={run_dir}",
                "output.tensorboard=false",
                "train.progress=false",
            ],
        )
        trainer = Trainer(cfg)
        for step in range(steps):
            with trainer.diagnostics.step(step + 1):
                trainer.engine.train_step(trainer.micro_batches(step))
        return trainer.diagnostics.timing()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/study-cpu.yaml")
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    print(
        "| variant | plain step (s) | measured step (s) | difference | inside the "
        "instrumentation (s) | share of a plain step | amortised at k=25 |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant in args.variants:
        t = measure(args.config, variant, args.steps, args.overrides)
        share = t["instrument_share"]
        print(
            f"| {variant} | {t['unmeasured_step_s']:.3f} | {t['measured_step_s']:.3f} "
            f"| {100 * t['overhead_per_measured_step']:+.1f}% | {t['instrument_s']:.4f} "
            f"| {100 * share:.1f}% | {100 * share / 25:.2f}% |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
