"""Host work per training step, at almost no arithmetic: the CPU proxy of a host-bound GPU step.

At the 125M shape on a GPU the step is bound by the host (Python, autograd, one dispatch per
op), not by the GPU. Shrinking the arithmetic to almost nothing (12 layers x 64, one sequence
of 8 tokens, one thread) leaves, on a CPU, what the host does per step: that is measured
here, side by side in one process, for baseline, Block and Full AttnRes and a plain-PyTorch GPT
of the same shape (``plain_gpt.PlainGPT``), each eager, compiled per layer
(``runtime.compile: layer``) and compiled per chunk (``chunk``: here the whole model's 12
layers one graph); the plain GPT compiled per block (torchtitan's ``apply_compile``) and
whole (``torch.compile`` of its loss: embedding, blocks, head and loss one graph, the GPU
check's anchor). Baseline and Block are also compiled per layer with every guard on every call
(``runtime.guards: full``) beside the steady guards that ``auto`` takes
(``model/compiled_region.py``).

What one step is:

* ours: ``PipelineEngine.train_step`` at pp = dp = tp = 1 with ``runtime.dtype: bf16``, i.e.
  DeepSpeed's ``PipelineEngine.train_batch`` with its bf16 engine, what the trainer runs on one
  GPU (forward, backward, DeepSpeed's gradient bookkeeping, the bf16 optimizer's clip and
  AdamW step, the LR schedule, the loss returned as a float). The engine's bookkeeping is part
  of what is measured, since removing it where it does nothing is part of the point. The ops
  are those a compiled layer traces (``twophase`` depth attention, torch's RMSNorm, SDPA) in
  eager and compiled runs alike: what a compiled run does on a GPU, less the GPU-only
  kernels;
* the plain GPT: an ordinary torch loop (``zero_grad``, loss, ``backward``,
  ``clip_grad_norm_``, fused ``torch.optim.AdamW``); compiled: ``torch.compile`` of each
  block, as torchtitan's ``apply_compile``, or of the whole loss. fp32 weights, bf16
  arithmetic (``torch.autocast``, as a torchtitan bf16 run computes): a CPU without bf16
  matrix instructions takes ~8x as long for a bf16 matmul of this shape as for an fp32 one
  (105 against 13 us for ``[8, 64] x [64, 192]``), 144 of them a step, which is arithmetic a
  GPU does not pay. With both sides in bf16 that arithmetic is in both host times, not
  counted as ours alone.

Measured per variant: ``host_ms``, the process's CPU time per step (one thread: the host's
work, less sensitive than wall time to waiting for a core on a shared machine) and
``wall_ms``, medians; ``aten_ops``, aten calls per step that the profiler sees at the top
(``compile_bench.top_level_aten_calls``: from Python or from compiled code, not inside an op);
and, for the eager variants, ``host_reads``: reads of a tensor value on the host per step
(``host_reads.py``: on a GPU each is a wait for the device; a compiled step reads at most what
its eager twin reads).
The variants run interleaved, the order rotating each repetition, and the ratios are paired
(``bench/paired.py``) with their 95% intervals. The floors (issue 36), on each compiled path:
Block / baseline <= 1.10 in host time and <= 1.2 in aten ops, and the compiled baseline
within 1.2x of the compiled plain GPT's host time. With some twenty variants a repetition
lasts over a second, so the two steps of a pair can fall in different spells of a shared
machine; the floors are therefore also measured on their own (``floors``): the variants they
compare on the path ``auto`` takes on a GPU (ours per chunk, the plain GPT whole and per
block) interleaved among themselves, a repetition a few tenths of a second.

``run(out_dir)`` writes ``out_dir/host.json`` and returns it.
Usage: ``python -m bench.host_bench --out DIR [--backend inductor] [--reps N]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo

from bench.compile_bench import top_level_aten_calls
from bench.host_reads import reads_per_step
from bench.host_report import (
    COMPILES,
    FLOOR_VARIANTS,
    floors,
    markdown,
    ratio_of,
    ratios,
)
from bench.launch_job import REPO

CONFIG = REPO / "configs" / "tiny.yaml"
VOCAB = 257
# 12 x 64 (the 125M model's depth and block size), one sequence of 8 tokens
SHAPE = (
    "model.num_layers=12",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=8",
    "model.attnres.block_size=3",
)
STEP = (
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
    "train.steps=100000",
    "parallel.pp=1",
    "runtime.dtype=bf16",
    "model.attnres.impl=twophase",
    "runtime.fused_norm=off",
)
MODES = {"baseline": "baseline", "block": "block", "full": "full"}
# plain GPT variant tag -> how it compiles: not, each block, the whole loss
PLAIN = {"eager": "off", "compiled": "block", "whole": "whole"}
EVERY_GUARD = ("baseline", "block")  # also run compiled with runtime.guards: full


def _config(
    mode: str, compile: str, shape: tuple[str, ...], guards: str = "auto", backend="inductor"
):
    from attnres_dist.config import load_config

    words = [*shape, *STEP, f"model.attnres.mode={mode}", f"runtime.compile={compile}"]
    if compile != "off":
        words += [f"runtime.guards={guards}", f"runtime.compile_backend={backend}"]
    return load_config(CONFIG, words)


def engine_step(
    mode: str, compile: str, backend: str, shape: tuple[str, ...], launch, guards: str = "auto"
):
    """The step function of our bf16 engine at pp = 1 for ``mode`` and ``runtime.compile``
    (``guards``: the compiled steps' ``runtime.guards``)."""
    from attnres_dist.model.gpt import ModelBuilder
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.pipeline.engine import PipelineEngine
    from attnres_dist.runtime import select_runtime

    cfg = _config(mode, compile, shape, guards, backend)
    runtime = select_runtime(cfg.runtime, cfg.model.attnres.impl)
    builder = ModelBuilder(cfg.model, VOCAB, seed=0, runtime=runtime)
    engine = PipelineEngine(cfg, builder, ParallelDims(), launch)

    def step(window):
        return engine.train_step([window])

    deferred = None if engine.bookkeeping is None else engine.bookkeeping.deferred
    step.copied_without_wait = None if deferred is None else deferred.host  # host_reads.py
    return step


def plain_step(compile: str, backend: str, shape: tuple[str, ...]):
    """The plain GPT's ordinary torch training step (module docstring); ``compile``: ``off``,
    ``block`` (each block one graph) or ``whole`` (the loss one graph)."""
    from attnres_dist.optim import param_groups
    from bench.plain_gpt import PlainGPT

    cfg = _config("baseline", "off", shape)
    torch.manual_seed(0)
    model = PlainGPT(cfg.model, VOCAB).train()
    loss_fn = model.loss
    if compile == "block":  # torchtitan's apply_compile: each block one graph
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True)
    elif compile == "whole":
        loss_fn = torch.compile(model.loss, backend=backend, fullgraph=True)
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), fused=True
    )

    def step(window):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 arithmetic, as ours
            loss = loss_fn(window)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip, foreach=True)
        optimizer.step()
        return loss

    return step


def _timed(step, window, steps: int) -> tuple[float, float]:
    """Median (CPU time, wall time) in ms over ``steps`` steps."""
    cpu, wall = [], []
    for _ in range(steps):
        c, w = time.process_time(), time.perf_counter()
        step(window)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def _rotated(names, r: int) -> list:
    """``names`` in the order of repetition ``r``: rotated by ``r``, so that each variant
    runs at each position in turn."""
    names = list(names)
    k = r % len(names)
    return names[k:] + names[:k]


def run(
    out_dir: str | Path,
    backend: str = "inductor",
    reps: int = 12,
    steps: int = 5,
    warmup: int = 3,
    shape: tuple[str, ...] = SHAPE,
    floor_reps: int = 40,
) -> dict:
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    launch = init_distributed(ParallelDims(), seed=0, device="cpu")
    torch._dynamo.reset()  # no cache entries of models compiled before (make bench's others)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _config("baseline", "off", shape).model
        seq = int(model.seq_length)
        window = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(0))
        variants = {}
        for tag, compile in COMPILES.items():
            for name, mode in MODES.items():
                variants[f"{name}_{tag}"] = engine_step(mode, compile, backend, shape, launch)
        for tag, compile in PLAIN.items():
            variants[f"plain_{tag}"] = plain_step(compile, backend, shape)
        for name in EVERY_GUARD:  # the compiled steps without the steady stance
            variants[f"{name}_every_guard"] = engine_step(
                MODES[name], "layer", backend, shape, launch, guards="full"
            )
        for step in variants.values():  # compiles, and settles allocator and caches
            for _ in range(warmup):
                step(window)
        for step in variants.values():  # after the last compile: a steady engine's
            step(window)  # every-guard step that compiles nothing (SteadyGuards)
        names = list(variants)
        samples = {n: {"host_ms": [], "wall_ms": []} for n in names}
        for r in range(reps):
            for n in _rotated(names, r):
                cpu, wall = _timed(variants[n], window, steps)
                samples[n]["host_ms"].append(cpu)
                samples[n]["wall_ms"].append(wall)
        floor_samples = {n: {"host_ms": []} for n in FLOOR_VARIANTS}  # the floors on their own
        for r in range(floor_reps):
            for n in _rotated(FLOOR_VARIANTS, r):
                floor_samples[n]["host_ms"].append(_timed(variants[n], window, steps)[0])
        ops = {n: top_level_aten_calls(lambda s=s: s(window)) for n, s in variants.items()}
        # eager variants only: a function mode is part of what compiled code guards on (a step
        # under one recompiles), and a compiled region (fullgraph) cannot read a value anyway,
        # so a compiled step reads what its eager twin reads outside the layers, or less
        reads = {
            n: reads_per_step(s, window, allowed=getattr(s, "copied_without_wait", None))
            for n, s in variants.items()
            if n.endswith("_eager")
        }
    finally:
        torch.set_num_threads(threads)
    result = {
        "config": {
            "shape": list(shape),
            "layers_x_hidden": f"{model.num_layers} x {model.hidden_size}",
            "step": list(STEP),
            "batch": 1,
            "seq": seq,
            "threads": 1,
            "backend": backend,
            "reps": reps,
            "steps_per_rep": steps,
        },
        "variants": {
            n: {
                "host_ms": statistics.median(samples[n]["host_ms"]),
                "wall_ms": statistics.median(samples[n]["wall_ms"]),
                "aten_ops": ops[n],
            }
            | ({"host_reads": reads[n]} if n in reads else {})
            for n in names
        },
        "samples": samples,
    }
    result["ratios"] = ratios(samples, ops)
    result["floors"] = floors(floor_samples, ops)
    result["floor_samples"] = floor_samples
    result["steady_over_every_guard"] = {
        name: ratio_of(samples, f"{name}_compiled", f"{name}_every_guard", "host_ms")
        for name in EVERY_GUARD
    }
    (out / "host.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args(argv)
    result = run(args.out, backend=args.backend, reps=args.reps)
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
