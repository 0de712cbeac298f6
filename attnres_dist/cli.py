"""``attnres-dist``: one command, one subcommand per job.

    attnres-dist train --config configs/tiny.yaml model.num_layers=12 parallel.pp=2
    attnres-dist prepare-data docs/*.txt --output data/mycorpus
    attnres-dist report runs/a runs/b --out runs/report   (plots + markdown summary)
    attnres-dist export runs/tiny --output exported/tiny   (--format hf: Hugging Face)
    attnres-dist generate exported/tiny --prompt "def " --max-new-tokens 200
    attnres-dist import-hf path/to/llama --output runs/llama --mode block   (continue pretraining)
    attnres-dist profile --config configs/tiny.yaml --steps 5   (under torchrun, like train)

Every subcommand validates its input before any process group starts; a ``UserError`` prints
one line (``error: <field>: <problem and fix>``) and exits with code 2; a run stopped by a
guard (non-finite loss, a stalled pipeline neighbour) prints one line the same way and exits
with 3. ``--local_rank`` (passed by the ``deepspeed`` launcher) is accepted everywhere and
ignored in favour of ``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from attnres_dist.errors import TrainingHalted, UserError


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=8")


def _train(args) -> int:
    from attnres_dist.config import load_config

    cfg = load_config(args.config, args.overrides)
    from attnres_dist.train.metrics import skip_wandb_unless_used

    skip_wandb_unless_used(cfg.output.wandb)  # before Megatron is imported
    from attnres_dist.parallel.process_groups import shutdown_distributed
    from attnres_dist.train.trainer import Trainer

    try:
        summary = Trainer(cfg).train()
    except BaseException:
        # No barrier after a failure: the peers it would wait for may be dead or stuck, and the
        # error must reach the user now. A world of one has no peers and is torn down as usual.
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            shutdown_distributed()
        raise
    shutdown_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"final validation loss {summary['final_valid_loss']:.4f} "
            f"in {summary['wall_time_s']:.1f} s ({summary['tokens_per_s']:.0f} tokens/s)"
        )
    return 0


def _check_config(args) -> int:
    from attnres_dist.config import load_config

    cfg = load_config(args.config, args.overrides)
    plan = cfg.model.block_plan()
    print(f"ok: {plan.describe()}; world size {cfg.world_size}")
    if cfg.parallel.pp > 1:
        from attnres_dist.model.megatron_config import padded_vocab_size
        from attnres_dist.runtime import select_runtime

        m, p = cfg.model, cfg.parallel
        vocab = padded_vocab_size(m.vocab_size or 257, m.make_vocab_size_divisible_by, p.tp)
        dtype = select_runtime(cfg.runtime).activation_dtype  # bf16 payloads under bf16
        if p.schedule != "1f1b":  # chunks per rank and each transition, naive vs cached
            from attnres_dist.pipeline.virtual_report import format_virtual_plan, plan_for_config

            plan = plan_for_config(cfg, vocab, dtype.itemsize)
            print(format_virtual_plan(plan, p.cross_stage_cache))
            return 0
        from attnres_dist.pipeline.contract import boundary_specs_for_config, format_specs
        from attnres_dist.pipeline.partition import compute_parts, describe_parts

        print("\n".join(describe_parts(compute_parts(m, p.pp, p.partition, vocab), m.num_layers)))
        print(format_specs(boundary_specs_for_config(cfg, vocab, dtype)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres-dist", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model")
    _add_run_args(train)
    train.set_defaults(func=_train)

    check = sub.add_parser("check-config", help="validate a config and print the block plan")
    _add_run_args(check)
    check.set_defaults(func=_check_config)

    from attnres_dist.data import prepare_cmd

    prepare_cmd.add_parser(sub)
    from attnres_dist.diagnostics import report

    report.add_parser(sub)
    from attnres_dist import export

    export.add_parsers(sub)
    from attnres_dist import import_hf

    import_hf.add_parser(sub)
    from attnres_dist.profile import runner as profile_runner

    profile_runner.add_parser(sub)
    return parser


def _split_local_rank(argv: list[str]) -> list[str]:
    """Drop ``--local_rank=N`` wherever the launcher put it (before or after the subcommand)."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            continue
        if arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            skip = True
            continue
        out.append(arg)
    return out


# Notices from third-party imports that say nothing actionable on a CPU box: Megatron-Core
# announcing its torch fallbacks when Apex / Transformer Engine are absent. The fast paths that
# are actually used are reported by the trainer.
_QUIET = (
    r".*(Apex|Transformer Engine and Apex) (is|are) not installed.*",
    r"full scope is deprecated.*",
)


def main(argv: list[str] | None = None) -> int:
    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    argv = _split_local_rank(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, TrainingHalted) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
