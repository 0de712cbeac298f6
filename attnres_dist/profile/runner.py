"""``attnres-dist profile``: profile the stage-to-stage communication of a pipelined run.

Launched like training (torchrun, deepspeed, mpirun) with the same config and overrides. Every
rank builds the run with the ``Trainer``, calibrates its links to the neighbouring stages with a
ping-pong, runs ``--warmup`` unrecorded steps, ``--steps`` measured steps (schedule timers and
the wire tap only) and ``--trace-steps`` steps under ``torch.profiler``, which writes one Chrome
trace per rank. Rank 0 gathers everything and writes ``comm_profile.json``, ``comm_report.md``
and the PNG plots into the run directory (``output.run_dir``).

The profiler steps train the model (optimizer steps included): the schedule measured is the
training schedule. ``train.steps`` only shapes the learning-rate schedule here.

With ``parallel.schedule`` dualpipev or interleaved the bytes are predicted and measured per
transition (chunk c -> c + 1), naive vs cached (``profile/virtual.py``); every schedule's
profile sets the measured bubble next to the schedule's theoretical one.

``--modes baseline,full,block`` profiles the same model in each residual mode, one after the
other in the same launch (``output.run_dir/<mode>/``), to compare what each puts on the wire.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from attnres_dist.config.block_plan import MODES
from attnres_dist.errors import ConfigError, UserError
from attnres_dist.profile.volumes import PAPER_WHAT_IF, parse_what_if


@dataclass
class ProfileOptions:
    warmup: int = 2
    steps: int = 5
    trace_steps: int = 1
    what_ifs: list[dict] = field(default_factory=lambda: [dict(PAPER_WHAT_IF)])
    pingpong_reps: int = 8
    modes: list[str] | None = None  # None: the config's mode, written to output.run_dir


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "profile",
        help="profile stage-to-stage communication of a pipelined run",
        description=(
            "Run warm-up and measured pipeline steps and write a Chrome trace per rank, "
            "comm_profile.json, comm_report.md and PNG plots into output.run_dir."
        ),
    )
    parser.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.pp=3")
    parser.add_argument("--warmup", type=int, default=2, help="unrecorded steps first")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument(
        "--trace-steps", type=int, default=1, help="steps under torch.profiler (Chrome traces)"
    )
    parser.add_argument(
        "--what-if",
        action="append",
        default=None,
        metavar="P=4,V=2,N=8",
        help="pipeline volume what-if (stages, virtual stages, blocks); repeatable",
    )
    parser.add_argument("--pingpong-reps", type=int, default=8, help="calibration round trips")
    parser.add_argument(
        "--modes",
        default=None,
        metavar="baseline,full,block",
        help="profile these residual modes in turn, each into output.run_dir/<mode>/",
    )
    parser.set_defaults(func=main)
    return parser


def options_from_args(args) -> ProfileOptions:
    for name in ("warmup", "steps", "trace_steps", "pingpong_reps"):
        low = 0 if name in ("warmup", "trace_steps") else 1
        if getattr(args, name) < low:
            flag = "--" + name.replace("_", "-")
            raise UserError(flag, f"got {getattr(args, name)}; must be >= {low}")
    try:
        what_ifs = [parse_what_if(w) for w in (args.what_if or [])] or [dict(PAPER_WHAT_IF)]
    except ValueError as exc:
        raise UserError("--what-if", str(exc).split(": ", 1)[-1]) from None
    modes = None
    if args.modes:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise UserError("--modes", f"got {args.modes!r}; allowed: {', '.join(MODES)}")
    return ProfileOptions(
        args.warmup, args.steps, args.trace_steps, what_ifs, args.pingpong_reps, modes
    )


def main(args) -> int:
    from attnres_dist.config import load_config

    cfg = load_config(args.config, args.overrides)
    opts = options_from_args(args)
    from attnres_dist.train.metrics import skip_wandb_unless_used

    skip_wandb_unless_used(cfg.output.wandb)  # before Megatron is imported
    from attnres_dist.parallel.process_groups import shutdown_distributed
    from attnres_dist.profile.report import key_table

    try:
        profiles = profile_runs(cfg, opts)
    except BaseException:
        # no teardown barrier after a failure: the peers it would wait for may be gone
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            shutdown_distributed()
        raise
    shutdown_distributed()
    for profile in profiles:
        if profile is not None:
            print(f"profile written to {profile['files']['dir']}")
            print(key_table(profile))
    return 0


def profile_runs(cfg, opts: ProfileOptions) -> list[dict | None]:
    """One profile per requested mode (or the config's own); collective over all ranks."""
    if cfg.parallel.pp < 2:
        raise ConfigError(
            "parallel.pp", f"got {cfg.parallel.pp}; the profiler needs a pipeline of >= 2 stages"
        )
    if not opts.modes:
        return [profile_run(cfg, opts)]
    from attnres_dist.config import config_from_dict

    configs = []
    for mode in opts.modes:  # every config validated before any process group starts
        raw = cfg.to_dict()
        raw["model"]["attnres"]["mode"] = mode
        raw["output"]["run_dir"] = str(Path(cfg.output.run_dir) / mode)
        configs.append(config_from_dict(raw))
    return [profile_run(c, opts) for c in configs]


def profile_run(cfg, opts: ProfileOptions) -> dict | None:
    """Profile one run (collective over all ranks); rank 0 returns the profile dict."""
    if cfg.parallel.pp < 2:
        raise ConfigError(
            "parallel.pp", f"got {cfg.parallel.pp}; the profiler needs a pipeline of >= 2 stages"
        )
    cfg.output.tensorboard = False  # the profile writes its own files, not training metrics
    cfg.train.progress = False
    from attnres_dist.train.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        return _profile(trainer, opts)
    finally:
        trainer.metrics.close()


def _profile(trainer, opts: ProfileOptions) -> dict | None:
    import torch
    import torch.distributed as dist

    from attnres_dist.pipeline.contract import boundary_specs_for_config
    from attnres_dist.profile.calibrate import calibrate_links, clock_offsets
    from attnres_dist.profile.schedule import ScheduleTimer
    from attnres_dist.profile.wire import WireTap

    cfg, dims, rank = trainer.cfg, trainer.dims, trainer.launch.rank
    engine = trainer.engine
    ds_engine = engine.engine
    vocab = trainer.builder.vocab_size
    dtype = trainer.runtime.activation_dtype
    transitions = None
    if cfg.parallel.schedule != "1f1b":  # per transition from the cache plan, not per stage
        from attnres_dist.pipeline.virtual_report import plan_for_config
        from attnres_dist.profile.virtual import sends_cached, transition_specs

        plan = plan_for_config(cfg, vocab, dtype.itemsize)
        transitions = transition_specs(plan, sends_cached(ds_engine, cfg))
        specs, sizes = [], {}
        for t in transitions:  # the largest payload between stage s and s + 1
            low = min(t["src_rank"], t["dst_rank"])
            if abs(t["src_rank"] - t["dst_rank"]) == 1:
                sizes[low] = max(sizes.get(low, 0), t["predicted_bytes"])
    else:
        specs = boundary_specs_for_config(cfg, vocab, dtype)
        sizes = {s.sender: s.bytes_forward for s in specs}
    links = calibrate_links(dims, rank, sizes, reps=opts.pingpong_reps)
    run_dir = Path(cfg.output.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)

    step = 0
    with WireTap([ds_engine], rank) as tap, ScheduleTimer(ds_engine, rank) as timer:
        timer.enabled = False  # the tap stays on: DeepSpeed sends shape metadata in step 1
        for _ in range(opts.warmup):
            tap.begin_step(step)
            engine.train_step(trainer.micro_batches(step))
            step += 1
        meta_bytes = sum(t.meta_bytes for t in tap.transfers)
        tap.transfers.clear()
        timer.enabled = True
        for _ in range(opts.steps):
            tap.begin_step(step)
            micro = trainer.micro_batches(step)
            timer.run_step(step, lambda m=micro: float(engine.train_step(m)))  # waits for it
            step += 1
        tap.enabled = timer.enabled = False
        trace = None
        if opts.trace_steps:
            trace = _trace(trainer, step, opts.trace_steps, run_dir / f"trace_rank{rank}.json")
            step += opts.trace_steps
    mine = {
        "rank": rank,
        "events": [e.to_dict() for e in timer.events],
        "transfers": [t.to_dict() for t in tap.transfers],
        "steps": timer.steps,
        "stray": tap.stray,
        "meta_bytes": meta_bytes + sum(t.meta_bytes for t in tap.transfers),
        "trace": trace,
    }
    gathered: list = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    offsets = clock_offsets(links, dims)
    for r in gathered:
        r["offset"] = offsets.get(r["rank"], 0.0)
    from attnres_dist.profile.report import build_profile, write_outputs

    # with tensor parallelism DeepSpeed splits each payload over the tensor ranks
    partitioned = {
        "forward": bool(ds_engine.is_pipe_partitioned),
        "backward": bool(ds_engine.is_grad_partitioned),
    }
    profile = build_profile(
        trainer, opts, specs, links, gathered, torch.get_num_threads(), partitioned, transitions
    )
    write_outputs(profile, run_dir)
    return profile


def _trace(trainer, first_step: int, steps: int, path: Path) -> dict:
    """Run ``steps`` steps under torch.profiler; export the Chrome trace; count gloo bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for step in range(first_step, first_step + steps):
            trainer.engine.train_step(trainer.micro_batches(step))
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    counts = {"gloo:send": [0, 0], "gloo:recv": [0, 0]}  # [events, bytes]
    sizes = {"float": 4, "double": 8, "int": 4, "long int": 8, "c10::BFloat16": 2, "c10::Half": 2}
    events = json.loads(path.read_text()).get("traceEvents", [])
    for ev in events:
        name = ev.get("name")
        if name in counts:
            args = ev.get("args", {})
            dims = (args.get("Input Dims") or [[]])[0]
            kind = (args.get("Input type") or ["float"])[0]
            numel = 1
            for d in dims:
                numel *= d
            counts[name][0] += 1
            counts[name][1] += numel * sizes.get(kind, 4)
    return {
        "file": path.name,
        "steps": steps,
        "events": len(events),
        "gloo_send": {"count": counts["gloo:send"][0], "bytes": counts["gloo:send"][1]},
        "gloo_recv": {"count": counts["gloo:recv"][0], "bytes": counts["gloo:recv"][1]},
    }
