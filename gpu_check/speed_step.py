"""The GPU check's speed steps: how fast a training step of baseline, Block and Full AttnRes
runs, eager, compiled and replayed as CUDA graphs (``runtime.compile: chunk``: at pp = 1 the
layers one region), beside a compiled plain-PyTorch GPT.

Two steps, one device call of about five minutes each (``make gpu-speed`` runs both, one call
per step; docs/gpu.md): ``speed_125m`` (12 x 768, sequence 1024, micro-batch 32 then 8) and
``speed_1b`` (24 x 2048, sequence 2048, micro-batch 4), both bf16 on one GPU (DeepSpeed's bf16
engine, local spec, no recompute), Block with 8 blocks. In each, before anything is timed:

* the floors (``bench/speed_floor.py``): the step's model FLOPs, and the bytes Block must move
  beyond the baseline (paper Table 1);
* the ceilings, measured in the same process: a bf16 matrix product's rate and a device copy's
  bandwidth (read + written bytes), on random data, timed with CUDA events.

Then rows, in order of importance (what the floors in ``FLOORS`` need first), each cut when the
step's time runs out and reported as skipped: per (micro-batch, mode, path) the median step
time over CUDA events, tokens/s, MFU against the measured matrix rate, the first step's time
(compilation and graph recording for the compiled paths), kernel launches per step (one step
under torch.profiler: ``cudaLaunchKernel``-family calls and ``cudaGraphLaunch``) and peak
memory. The anchor: ``bench/plain_gpt.py`` compiled whole (``torch.compile``, default mode),
bf16 autocast over fp32 weights, fused AdamW. ``speed_125m`` also exports a one-step baseline and
Block run and times greedy decoding of the Hugging Face model with its KV cache.

A dry run (CPU) runs every row at a tiny shape in fp32, compiling with ``aot_eager`` (the trace
and autograd graphs, no code generation) so that it takes seconds; graphed rows, launches and
ceilings need CUDA and say so.
"""

from __future__ import annotations

import functools
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench import speed_floor
from gpu_check import speed_report


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    block_size: int  # sublayers per block: 8 blocks at both shapes
    micro_batches: tuple[int, ...]
    decode: bool = False

    def overrides(self) -> list[str]:
        return [
            f"model.num_layers={self.layers}",
            f"model.hidden_size={self.hidden}",
            f"model.num_attention_heads={self.heads}",
            f"model.seq_length={self.seq}",
            f"model.attnres.block_size={self.block_size}",
        ]


SHAPES = {
    "speed_125m": Shape("125M", 12, 768, 12, 1024, 3, (32, 8), decode=True),
    "speed_125m_compiled": Shape("125M", 12, 768, 12, 1024, 3, (32, 8)),
    "speed_1b": Shape("1.3B", 24, 2048, 16, 2048, 6, (4,)),
}
# a dry run keeps each step's code path and its number of micro-batch sizes, not the size
DRY = {
    "speed_125m": Shape("dry-run", 2, 64, 4, 64, 2, (2, 1), decode=True),
    "speed_125m_compiled": Shape("dry-run", 2, 64, 4, 64, 2, (2, 1)),
    "speed_1b": Shape("dry-run", 2, 64, 4, 64, 2, (1,)),
}
MODES = ("baseline", "block", "full")
# compiled per chunk (at pp = 1 every layer in one region): the least host work per step on
# the CPU proxy (bench/host_bench.py), and graphed, one CUDA graph tree over the whole chunk
PATHS = {
    "eager": [],
    "compiled": ["runtime.compile=chunk"],
    "graphed": ["runtime.compile=chunk", "runtime.cuda_graphs=on"],
}


def plan(name: str, shape: Shape) -> list[tuple]:
    """The rows in order of importance: eager AttnRes and the anchor at every micro-batch, the
    decode timing, then per micro-batch and mode compiled beside graphed (the graphed region
    reuses the compiled one's kernels from the caches, so a pair costs little more than one
    compile). A ``_compiled`` step runs only the compiled and graphed rows."""
    rows = []
    if not name.endswith("_compiled"):
        for mb in shape.micro_batches:
            rows += [("model", mb, m, "eager") for m in MODES] + [("plain", mb, "plain", "")]
        if shape.decode:
            rows.append(("decode", 0, "", ""))
    for mb in shape.micro_batches:
        rows += [("model", mb, m, p) for m in MODES for p in ("compiled", "graphed")]
    return rows


def _cuda(dry: bool) -> bool:
    import torch

    return torch.cuda.is_available() and not dry


def _timed(step, warmup: int, reps: int, cuda: bool) -> tuple[float, list[float]]:
    """(seconds of the first call, each timed call's seconds): ``step(i)`` called ``warmup``
    times untimed (the first timed on the host: it compiles), then ``reps`` times between CUDA
    events (host clock on a CPU)."""
    import torch

    start = time.perf_counter()
    step(0)
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    for i in range(1, warmup):
        step(i)
    times = []
    for i in range(warmup, warmup + reps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step(i)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t0)
    return first, times


def _launches(step, i: int) -> dict:
    """Kernel launches and CUDA graph launches on the host over one call of ``step(i)``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from gpu_check.step_profile import LAUNCH_CALLS

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(i)
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU]
    return {
        "launches": sum(e.count for e in events if e.key in LAUNCH_CALLS),
        "graph_launches": sum(e.count for e in events if e.key.startswith("cudaGraphLaunch")),
    }


def _sig(x: float) -> float:
    """Four significant digits (a CPU's rate is a small fraction of a TFLOP/s)."""
    return float(f"{x:.4g}")


def ceilings(cuda: bool) -> dict:
    """A bf16 matrix product's rate (8192^3) and a device copy's bandwidth (1 GiB, read +
    written), median of 20 over CUDA events, on random data; a CPU gets small sizes."""
    import torch

    device, n, copy_mib = ("cuda", 8192, 1024) if cuda else ("cpu", 256, 16)
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=gen, dtype=torch.bfloat16) for _ in "ab")
    src = torch.randn(copy_mib * 2**18, device=device, generator=gen)
    dst = torch.empty_like(src)
    _, mm = _timed(lambda i: torch.mm(a, b), 3, 20, cuda)
    _, cp = _timed(lambda i: dst.copy_(src), 3, 20, cuda)
    return {
        "matmul_tflops": _sig(2 * n**3 / statistics.median(mm) / 1e12),
        "matmul_n": n,
        "copy_gbs": _sig(2 * src.numel() * 4 / statistics.median(cp) / 1e9),
        "copy_mib": copy_mib,
        "device": device,
    }


def floors(shape: Shape, vocab: int, ceiling: dict) -> dict:
    """Per micro-batch: the step's model FLOPs and their time at the measured matrix rate, and
    Block's bytes beyond the baseline and their time at the measured copy bandwidth."""
    out = {}
    for mb in shape.micro_batches:
        tokens = mb * shape.seq
        ffn = _model_config(shape).ffn_size
        mm = speed_floor.matmul_flops(
            shape.layers, shape.hidden, shape.heads, shape.heads, ffn, vocab, tokens
        )
        flops = mm + speed_floor.attention_flops(shape.layers, shape.hidden, shape.seq, tokens)
        extra = speed_floor.block_extra_bytes(shape.layers, shape.block_size, shape.hidden, tokens)
        out[str(mb)] = {
            "tokens": tokens,
            "flops": flops,
            "flop_floor_ms": round(1e3 * flops / (ceiling["matmul_tflops"] * 1e12), 3),
            "block_extra_bytes": extra,
            "block_extra_floor_ms": round(1e3 * extra / (ceiling["copy_gbs"] * 1e9), 3),
        }
    return out


@functools.cache
def _model_config(shape: Shape):
    from attnres_dist.config import load_config

    overrides = [*shape.overrides(), "parallel.pp=1", "parallel.dp=1"]
    return load_config("configs/gpt-125m.yaml", overrides).model


def _trainer(work: Path, shape: Shape, mb: int, mode: str, path: str, dry: bool, steps: int):
    from attnres_dist.config import load_config
    from attnres_dist.train.trainer import Trainer
    from gpu_check.common import dtype_override
    from gpu_check.train_steps import QUIET, SHAPE_125M

    overrides = [*SHAPE_125M, *shape.overrides(), f"model.attnres.mode={mode}"]
    overrides += [f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}"]
    overrides += [f"train.steps={steps}", "runtime.layer_spec=local", dtype_override(dry), *QUIET]
    overrides += [*PATHS[path], f"output.run_dir={work / f'speed-{mb}-{mode}-{path}'}"]
    if dry and path == "compiled":  # traced and differentiated, no code generated: seconds
        overrides.append("runtime.compile_backend=aot_eager")
    return Trainer(load_config("configs/gpt-125m.yaml", overrides))


def model_row(work: Path, shape: Shape, mb: int, mode: str, path: str, dry: bool) -> dict:
    """One (micro-batch, mode, path) of the project's model."""
    cuda = _cuda(dry)
    if path == "graphed" and not cuda:
        return {"skipped": "CUDA graphs need a CUDA device"}
    warmup, reps = (3, 5) if cuda else (2, 2)  # graph trees: warm up, record, then replay
    trainer = _trainer(work, shape, mb, mode, path, dry, warmup + reps + 2)

    def step(i):
        trainer.engine.train_step(trainer.micro_batches(i))

    first, times = _timed(step, warmup, reps, cuda)
    row = {"first_step_s": round(first, 2), "step_s": statistics.median(times)}
    row |= {"runtime": trainer.runtime.describe(), "vocab": trainer.builder.vocab_size}
    if cuda:
        row |= _launches(step, warmup + reps)
    if path != "eager":  # the graphs' memory pool and compiled code go with the trainer
        import torch._dynamo
        from torch._inductor import cudagraph_trees

        torch._dynamo.reset()
        cudagraph_trees.reset_cudagraph_trees()
    return row


def plain_row(shape: Shape, mb: int, vocab: int, dry: bool) -> dict:
    """The anchor: PlainGPT compiled whole, bf16 autocast over fp32 weights, fused AdamW."""
    import torch

    from bench.plain_gpt import PlainGPT

    cuda = _cuda(dry)
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    gpt = PlainGPT(_model_config(shape), vocab).to(device)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4, fused=cuda)
    loss_fn = torch.compile(gpt.loss, backend="inductor" if cuda else "aot_eager")
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, vocab, (mb, shape.seq + 1), generator=gen) for _ in range(2)]
    windows = [w.to(device) for w in windows]

    def step(i):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(windows[i % 2])
        loss.backward()
        optimizer.step()

    warmup, reps = (3, 5) if cuda else (2, 2)
    first, times = _timed(step, warmup, reps, cuda)
    row = {"first_step_s": round(first, 2), "step_s": statistics.median(times)}
    return row | (_launches(step, 0) if cuda else {})


def decode_rows(work: Path, shape: Shape, dry: bool) -> dict:
    """Greedy decoding of the exported Hugging Face model (its KV cache), baseline and Block,
    each trained one step at ``shape`` (micro-batch 1) and exported."""
    from attnres_dist.export import export_checkpoint, exported_tokenizer, load_for_generation
    from gpu_check.common import dtype_override
    from gpu_check.train_steps import QUIET, SHAPE_125M, timed_generation, train

    device = "cuda" if _cuda(dry) else "cpu"
    new = 256 if device == "cuda" else 8
    out = {}
    for mode in ("baseline", "block"):
        run_dir = work / f"decode-{mode}"
        overrides = [*SHAPE_125M, *shape.overrides(), f"model.attnres.mode={mode}"]
        overrides += ["train.micro_batch_size=1", "train.global_batch_size=1", "train.steps=1"]
        overrides += ["optim.warmup_steps=0"]
        overrides += ["train.eval_batches=1", "checkpoint.every=0", "runtime.layer_spec=local"]
        overrides += [dtype_override(dry), *QUIET, f"output.run_dir={run_dir}"]
        train("configs/gpt-125m.yaml", overrides)
        export = export_checkpoint(run_dir, work / f"export-{mode}", warn=print)
        hf, info = load_for_generation(export, device)
        timing = timed_generation(hf, exported_tokenizer(export, info), shape.seq, new)
        out[mode] = timing | {"device": device}
        del hf
    return out


def speed(name: str, work: Path, dry: bool) -> dict:
    """Step ``name`` (``speed_125m`` or ``speed_1b``): ceilings, floors, then ``plan``'s rows
    until the step's time runs out; the result is saved after every row. A row that raises is
    recorded with its error and the rest still run; the step then fails, naming them."""
    from gpu_check.common import peak_gib, reset_peak, save_result, step_limit_s

    shape = DRY[name] if dry else SHAPES[name]
    deadline = time.monotonic() + step_limit_s(300) - 20
    cuda = _cuda(dry)
    result = {"step": name, "shape": shape.__dict__, "dtype": "bf16" if cuda else "fp32 (dry run)"}
    result["ceilings"] = ceilings(cuda)
    vocab = None
    result["rows"] = []
    for kind, mb, mode, path in plan(name, shape):
        row = {"kind": kind, "micro_batch": mb, "mode": mode, "path": path}
        if time.monotonic() > deadline:
            result["rows"].append(row | {"skipped": "the step's time limit"})
            continue
        reset_peak()
        start = time.monotonic()
        try:
            if kind == "model":
                row |= model_row(work, shape, mb, mode, path, dry)
                vocab = vocab or row.get("vocab")
            elif kind == "plain" and vocab is None:
                row["skipped"] = "no model row ran to give the vocabulary"
            elif kind == "plain":
                row |= plain_row(shape, mb, vocab, dry)
            else:
                row["decode"] = decode_rows(work, shape, dry)
        except Exception as exc:  # recorded, its traceback in the log; the step fails at the end
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        row |= {"wall_s": round(time.monotonic() - start, 1), "peak_gib": peak_gib()}
        result["rows"].append(row)
        if vocab is not None:
            result["floors"] = floors(shape, vocab, result["ceilings"])
        result |= speed_report.derive(result)
        print("speed", {k: v for k, v in row.items() if k != "runtime"}, flush=True)
        save_result(result)
    errors = [
        f"{r['kind']} {r['mode']} {r['path']} mb {r['micro_batch']}: {r['error']}"
        for r in result["rows"]
        if "error" in r
    ]
    if errors:
        raise RuntimeError(f"{len(errors)} row(s) failed: {'; '.join(errors)}")
    return result
