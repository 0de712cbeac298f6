"""Compiled layers counted (``runtime.compile: layer``): graphs, breaks, recompiles, compile time
and aten ops per training step, eager against compiled, for each residual mode.

For each mode (baseline, Block, Full) at one shape, with the ops a compiled layer runs (the
torch two-phase depth attention, torch's RMSNorm, SDPA), in one process:

* ``graphs`` and ``graph_breaks``: TorchDynamo's ``explain`` of every layer's region
  (``AttnResLayer.sublayers``) and the final aggregation's (``FinalAggregation.aggregate``),
  summed (a whole model: one graph per layer and one more, no break);
* ``compiled_graphs``: graphs compiled in the first training step (one per region), and
  ``recompiles``: graphs compiled by the steps after it (0: every guard held);
* ``compile_s``: the first compiled step's time less a steady compiled step's (the cost of
  compiling every layer with the chosen backend), beside ``eager_step_ms`` and
  ``compiled_step_ms`` (medians);
* ``aten_ops``: aten calls per training step (forward and backward) as the profiler sees them
  at the top (calls from Python or from compiled code, not those an op makes inside itself),
  eager and compiled: what fusing the region takes off the dispatcher.

``run(out_dir)`` writes ``out_dir/compile.json`` and returns it.
Usage: ``python -m bench.compile_bench --out DIR [--backend aot_eager]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.launch_job import REPO

CONFIG = REPO / "configs" / "tiny.yaml"
VOCAB = 257
MODES = {
    "baseline": ("model.attnres.mode=baseline",),
    "block": (),
    "full": ("model.attnres.mode=full",),
}
OPS = ("model.attnres.impl=twophase", "runtime.fused_norm=off")


def _model(overrides: list[str]):
    from attnres_dist.config import load_config
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
    from attnres_dist.runtime import select_runtime

    cfg = load_config(CONFIG, [*overrides, *OPS])
    runtime = select_runtime(cfg.runtime, cfg.model.attnres.impl)
    model = AttnResGPT(ModelBuilder(cfg.model, VOCAB, seed=0, runtime=runtime))
    return model.train()


def _step(model, window) -> float:
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model.loss(window).backward()
    return time.perf_counter() - start


def aten_ops(model, window) -> int:
    """Top-level aten calls of one training step (forward and backward)."""
    return top_level_aten_calls(lambda: _step(model, window))


def top_level_aten_calls(fn) -> int:
    """Aten calls of ``fn()`` that the profiler sees at the top (from Python or compiled
    code), not those an aten op makes inside itself."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += event.name.startswith("aten::") and parent is None
    return count


def _explain(model, window) -> tuple[int, int]:
    """(graphs, breaks) of every layer's region and the final aggregation's, summed."""
    import torch._dynamo

    from attnres_dist.model.compiled_region import state_region
    from attnres_dist.model.sequence_context import sequence_context

    def explain(fn, *args):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args)
        return explained.graph_count, explained.graph_break_count

    counts = []
    with torch.no_grad():
        state = model.embedding(window[:, :-1])
        for layer in model.layers:
            like, seq_dim = (state.partial, 0) if state.store is None else (state.store, 1)
            ctx = sequence_context(layer.layer.config, like, layer.rotary_base, seq_dim=seq_dim)
            counts.append(explain(state_region(layer.sublayers), state, ctx))
            state = layer(state)
        counts.append(explain(model.final.aggregate, state))
    graphs, breaks = (sum(c) for c in zip(*counts, strict=True))
    return graphs, breaks


def measure_mode(overrides: list[str], window, backend: str, steps: int) -> dict:
    import torch._dynamo

    from attnres_dist.model.gpt import compile_regions

    eager = _model(overrides)
    graphs, breaks = _explain(eager, window)
    eager_ms = [_step(eager, window) for _ in range(steps)][1:]
    compiled = _model(overrides)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    compile_regions(compiled, backend)
    counters = torch._dynamo.utils.counters
    counters.clear()
    first = _step(compiled, window)
    compiled_graphs = counters["stats"]["unique_graphs"]
    later = [_step(compiled, window) for _ in range(steps - 1)]
    steady = statistics.median(later)
    return {
        "graphs": graphs,
        "graph_breaks": breaks,
        "compiled_graphs": compiled_graphs,
        "recompiles": counters["stats"]["unique_graphs"] - compiled_graphs,
        "compile_s": first - steady,
        "eager_step_ms": statistics.median(eager_ms) * 1e3,
        "compiled_step_ms": steady * 1e3,
        "aten_ops": {"eager": aten_ops(eager, window), "compiled": aten_ops(compiled, window)},
    }


def run(
    out_dir: str | Path,
    backend: str = "inductor",
    shape: tuple[str, ...] = (),
    batch: int = 4,
    seq: int = 128,
    steps: int = 6,
) -> dict:
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    init_distributed(ParallelDims(), seed=0)  # Megatron's layers need its (1-rank) groups
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*shape, f"model.seq_length={seq}"]
    window = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    result = {
        "config": {"backend": backend, "shape": list(shape), "batch": batch, "seq": seq},
        "modes": {
            m: measure_mode([*overrides, *o], window, backend, steps) for m, o in MODES.items()
        },
    }
    (out / "compile.json").write_text(json.dumps(result, indent=2))
    return result


def markdown_rows(result: dict) -> list[str]:
    """Summary rows (``bench.run``)."""
    c = result["config"]
    where = f"{c['backend']}, {c['batch']} x {c['seq']} tokens"
    rows = []
    for mode, m in result["modes"].items():
        ops = m["aten_ops"]
        rows.append(
            f"| compiled step time / eager, {mode} | "
            f"{m['compiled_step_ms'] / m['eager_step_ms']:.3f} | {where}: {m['graphs']} graphs, "
            f"{m['graph_breaks']} breaks, {m['compiled_graphs']} compiled, {m['recompiles']} "
            f"recompiles, compile {m['compile_s']:.1f} s; aten ops per step {ops['compiled']} vs "
            f"{ops['eager']} eager |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    result = run(args.out, backend=args.backend, steps=args.steps)
    print("\n".join(markdown_rows(result)))


if __name__ == "__main__":
    main()
