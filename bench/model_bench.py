"""Model-level benchmark (one process): what AttnRes costs over a plain residual, and what the
Megatron-layer model costs over a plain-PyTorch GPT.

Every number is a training step (forward + backward + AdamW) on one ``[batch, seq + 1]`` token
window, timed with every variant of a group interleaved (the order rotates each repetition)
and reported as the median; the machine is shared, so the ratios are the result, each the
median of the per-repetition ratios (``bench.paired``; ``ratio_intervals``: its
95% sign-test interval; ``ratios_of_medians`` beside them). Each step is
timed twice: wall clock (``ratios``) and the process's CPU time (``ratios_cpu``: all its
threads; less sensitive to waiting for a core on a loaded machine). One more step per variant
counts its aten calls (``aten_calls``: every call, views included; ``aten_compute_calls``:
without metadata-only ops), the per-op overhead a CPU step pays.

* ``step``: for each shape (``SHAPES``: the tiny default, the study's 12 x 64, a deep 32 x 64),
  baseline, Block and Full AttnRes, each on the old path (``model.attnres.impl=lean``,
  Megatron's core attention, torch's RMSNorm) and the new one (the config's default
  depth-attention implementation, ``runtime.core_attention=auto``,
  ``runtime.fused_norm=auto``). Ratios: AttnRes / baseline per path, and new / old per mode.
  The implementations are parameters (``old_impl``, ``new_impl``; None = the config's
  default), so a newly registered one is measured by naming it. The same steps also time
  the project's C kernels (``kernel_s``: seconds per step inside each entry point, by
  ``bench/kernel_time.py``); ``kernel_share`` sets the kernel time AttnRes adds beside
  the step time it adds (new path, paired medians).
* ``fixed_cost``: the same new-path baseline, Block and Full at each shape on ONE 8-token
  sequence, interleaved (``FIXED_REPS``): AttnRes's extra step time there is what does not
  scale with tokens (Python, autograd nodes, dispatch, the optimizer's extra tensors), set
  beside its extra time at full size (paired medians of the per-repetition differences).
* ``throughput``: tokens/s of ``make train-single``'s model (``configs/tiny.yaml``) on either
  path and of its baseline-residual twin, against ``PlainGPT`` of the same shape
  (``bench.plain_gpt``), in the same process and threads.

``run(out_dir)`` writes ``out_dir/model.json`` and returns it.
Usage: ``python -m bench.model_bench --out DIR [--quick]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from attnres_dist.optim import fused_adamw_supported, param_groups
from bench.kernel_time import kernel_clock
from bench.launch_job import REPO
from bench.paired import (
    median_ratio,
    paired_difference,
    paired_interval,
    paired_ratio,
)

CONFIG = REPO / "configs" / "tiny.yaml"
VOCAB = 257  # the byte tokenizer's
SHAPES: dict[str, tuple[str, ...]] = {
    "4x128 S=2": (),  # configs/tiny.yaml as it is
    "12x64 S=3": ("model.num_layers=12", "model.hidden_size=64", "model.attnres.block_size=3"),
    "32x64 S=4": ("model.num_layers=32", "model.hidden_size=64", "model.attnres.block_size=4"),
}
MODES = ("baseline", "block", "full")
DELTA_MODES = ("delta_block", "delta_full")  # measured on the new path only
THREADS = 2
# per-repetition step ratios spread by +-10% and more on a shared 2-core host, and the paired
# median of 15 repetitions moved by 4-5% between runs: 31 put it within a 97% sign-test
# interval of ranks 10 .. 22
REPS = 31
FLOOR_MEGATRON_OVER_PLAIN = 0.85
FIXED_TOKENS = 8  # the fixed-cost group's one sequence: arithmetic next to nothing
FIXED_REPS = 40  # its steps take milliseconds


def path_overrides(path: str, old_impl: str = "lean", new_impl: str | None = None) -> list[str]:
    """Config words of the ``old`` path (lean op, Megatron's attention, torch's RMSNorm) or the
    ``new`` one (the defaults: on CPU the fused kernels, SDPA and the C RMSNorm)."""
    if path == "old":
        return [
            f"model.attnres.impl={old_impl}",
            "runtime.core_attention=megatron",
            "runtime.fused_norm=off",
        ]
    impl = [] if new_impl is None else [f"model.attnres.impl={new_impl}"]
    return [*impl, "runtime.core_attention=auto", "runtime.fused_norm=auto"]


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Case:
    """One model and its optimizer, stepping on a fixed token window."""

    def __init__(self, model: torch.nn.Module, window: torch.Tensor, describe: str):
        self.model = model
        self.window = window
        self.describe = describe
        # the trainer's optimizer (attnres_dist.optim): AdamW, fused kernel, no decay on vectors
        self.optimizer = torch.optim.AdamW(
            param_groups(model, 0.1), lr=1e-4, fused=fused_adamw_supported(model)
        )
        self.model.train()

    def step(self) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        with kernel_clock() as kernels:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.loss(self.window).backward()
            self.optimizer.step()
        if self.window.is_cuda:
            torch.cuda.synchronize()
        self.last_cpu_s = time.process_time() - cpu
        self.last_kernel_s = kernels  # seconds inside each of the project's C kernels
        return time.perf_counter() - start

    def aten_calls(self) -> dict:
        """aten calls of one training step (forward, backward and optimizer)."""
        from bench.io_counter import OpBytesCounter

        with OpBytesCounter() as counter:
            self.step()
        return {"all": counter.calls, "compute": sum(counter.ops.values())}


def build_case(overrides: list[str], window: torch.Tensor, config=CONFIG) -> Case:
    """The project's model as ``make train-single`` builds it (runtime selection included)."""
    from attnres_dist.config import load_config
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
    from attnres_dist.runtime import select_runtime

    cfg = load_config(config, overrides)
    runtime = select_runtime(cfg.runtime)
    model = AttnResGPT(ModelBuilder(cfg.model, VOCAB, seed=cfg.train.seed, runtime=runtime))
    impl = cfg.model.attnres.impl
    describe = (
        f"{model.plan.describe()}; impl={impl}; {runtime.core_attention.value} attention; "
        f"{runtime.norm.value} RMSNorm"
    )
    return Case(model, window.to(model.device), describe)


def build_plain(overrides: list[str], window: torch.Tensor, config=CONFIG) -> Case:
    from attnres_dist.config import load_config
    from attnres_dist.model.megatron_config import padded_vocab_size
    from bench.plain_gpt import PlainGPT

    cfg = load_config(config, overrides)
    vocab = padded_vocab_size(VOCAB, cfg.model.make_vocab_size_divisible_by, 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = PlainGPT(cfg.model, vocab).to(device)
    return Case(model, window.to(device), "plain-PyTorch GPT (SDPA, RoPE, SwiGLU, RMSNorm)")


def interleaved(
    cases: dict[str, Case],
    reps: int,
    warmup: int,
    cpu: dict | None = None,
    kernels: dict | None = None,
) -> dict[str, list[float]]:
    """Step times per case; each repetition runs every case once, in a rotating order.
    ``cpu`` and ``kernels``, when given, receive each case's CPU-time samples and its steps'
    seconds inside the C kernels (a dict per step, by entry point)."""
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            elapsed = cases[name].step()
            if rep >= warmup:
                times[name].append(elapsed)
                if cpu is not None:
                    cpu.setdefault(name, []).append(cases[name].last_cpu_s)
                if kernels is not None:
                    kernels.setdefault(name, []).append(cases[name].last_kernel_s)
    return times


def _window(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, VOCAB - 1, (batch, seq + 1), generator=torch.Generator().manual_seed(seed)
    )


def _stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "samples": samples}


def step_group(
    shape: tuple[str, ...], window, reps: int, warmup: int, old_impl: str, new_impl: str | None
) -> dict:
    """Baseline, Block and Full on the old and the new path at one shape, and Delta Block and
    Delta Full on the new one, interleaved."""
    seq = window.shape[1] - 1
    cases = {}
    runs = [(m, p) for m in MODES for p in ("old", "new")] + [(m, "new") for m in DELTA_MODES]
    for mode, path in runs:
        words = [*shape, f"model.seq_length={seq}", f"model.attnres.mode={mode}"]
        cases[f"{mode}_{path}"] = build_case(
            [*words, *path_overrides(path, old_impl, new_impl)], window
        )
    cpu: dict[str, list[float]] = {}
    kernels: dict[str, list[dict]] = {}
    times = interleaved(cases, reps, warmup, cpu, kernels)
    calls = {name: case.aten_calls() for name, case in cases.items()}
    return {
        "variants": {
            n: {
                "model": c.describe,
                "step_s": _stats(times[n]),
                "cpu_s": _stats(cpu[n]),
                "kernel_s": _kernel_stats(kernels[n]),
                "aten_calls": calls[n]["all"],
                "aten_compute_calls": calls[n]["compute"],
            }
            for n, c in cases.items()
        },
        "kernel_share": _kernel_share(times, kernels),
        "ratios": _step_ratios(times),
        # how far the paired medians can be trusted (None below 6 repetitions)
        "ratio_intervals": _step_ratios(times, paired_interval),
        "ratios_cpu": _step_ratios(cpu),
        "ratios_of_medians": _step_ratios(times, median_ratio),
    }


def _kernel_stats(steps: list[dict]) -> dict:
    """Seconds per step inside the C kernels: each entry point's median and the total's
    samples (zeros where a path calls none)."""
    names = sorted({name for step in steps for name in step})
    return {
        "by_kernel": {n: statistics.median(step.get(n, 0.0) for step in steps) for n in names},
        **_stats([sum(step.values()) for step in steps]),
    }


def _kernel_share(times: dict[str, list[float]], kernels: dict[str, list[dict]]) -> dict:
    """New path, Block and Full: AttnRes's extra step time and the extra time its steps spent
    inside the C kernels (ms, paired medians over the same steps), and their quotient."""
    total = {n: [sum(step.values()) for step in steps] for n, steps in kernels.items()}
    out = {}
    for mode in ("block", "full"):
        a, b = f"{mode}_new", "baseline_new"
        step = paired_difference(times[a], times[b]) * 1e3
        kernel = paired_difference(total[a], total[b]) * 1e3
        share = kernel / step if step > 0 else None  # None: no extra step time
        out[mode] = {"extra_ms": step, "kernel_extra_ms": kernel, "share": share}
    return out


def fixed_cost_group(
    shape: tuple[str, ...], full_size: dict, reps: int, warmup: int, new_impl: str | None
) -> dict:
    """AttnRes's extra step time (ms) over the baseline on one ``FIXED_TOKENS`` sequence,
    beside the same difference in ``full_size`` (a :func:`step_group` result, new path)."""
    window = _window(1, FIXED_TOKENS)
    words = [*shape, f"model.seq_length={FIXED_TOKENS}", *path_overrides("new", "lean", new_impl)]
    cases = {m: build_case([*words, f"model.attnres.mode={m}"], window) for m in MODES}
    times = interleaved(cases, reps, warmup)
    full = {m: full_size["variants"][f"{m}_new"]["step_s"]["samples"] for m in MODES}
    out = {"tokens": FIXED_TOKENS, "step_ms": {m: statistics.median(times[m]) * 1e3 for m in MODES}}
    for mode in ("block", "full"):
        fixed = paired_difference(times[mode], times["baseline"]) * 1e3
        at_size = paired_difference(full[mode], full["baseline"]) * 1e3
        ratio = fixed / at_size if at_size > 0 else None  # None: no extra time at full size
        out[mode] = {"extra_ms": fixed, "extra_ms_full_size": at_size, "ratio": ratio}
    return out


def _step_ratios(times: dict[str, list[float]], estimate=paired_ratio) -> dict:
    """AttnRes / baseline per path and new / old per mode (``estimate``: paired by default,
    or any of ``bench.paired``'s estimates, such as its interval)."""
    ratios = {}
    for path in ("old", "new"):
        for mode in ("block", "full"):
            key = f"{mode}_over_baseline_{path}"
            ratios[key] = estimate(times[f"{mode}_{path}"], times[f"baseline_{path}"])
    for mode in MODES:
        ratios[f"{mode}_new_over_old"] = estimate(times[f"{mode}_new"], times[f"{mode}_old"])
    for mode in DELTA_MODES:
        key = f"{mode}_over_baseline_new"
        ratios[key] = estimate(times[f"{mode}_new"], times["baseline_new"])
    return ratios


def throughput_group(
    shape: tuple[str, ...], window, reps: int, warmup: int, old_impl, new_impl
) -> dict:
    """tokens/s of the train-single model (both paths), its baseline twin and the plain GPT."""
    seq = window.shape[1] - 1
    words = [*shape, f"model.seq_length={seq}"]
    cases = {
        "attnres_new": build_case([*words, *path_overrides("new", old_impl, new_impl)], window),
        "attnres_old": build_case([*words, *path_overrides("old", old_impl, new_impl)], window),
        "baseline_new": build_case(
            [*words, "model.attnres.mode=baseline", *path_overrides("new", old_impl, new_impl)],
            window,
        ),
        "plain": build_plain(words, window),
    }
    times = interleaved(cases, reps, warmup)
    tokens = window.shape[0] * seq
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    return {
        "variants": {
            n: {"model": c.describe, "tokens_per_s": rate[n], "step_s": _stats(times[n])}
            for n, c in cases.items()
        },
        # tokens/s ratios: plain's step time over the variant's, paired per repetition
        "ratios": {
            f"{name}_over_plain": paired_ratio(times["plain"], times[name])
            for name in ("attnres_new", "attnres_old", "baseline_new")
        },
        "ratios_of_medians": {
            f"{name}_over_plain": rate[name] / rate["plain"]
            for name in ("attnres_new", "attnres_old", "baseline_new")
        },
        "floor_attnres_over_plain": FLOOR_MEGATRON_OVER_PLAIN,
    }


def run(
    out_dir: str | Path,
    shapes: dict[str, tuple[str, ...]] | None = None,
    throughput_shape: tuple[str, ...] = (),
    batch: int = 16,
    seq: int = 128,
    reps: int = REPS,
    warmup: int = 2,
    old_impl: str = "lean",
    new_impl: str | None = None,
    fixed_reps: int = FIXED_REPS,
) -> dict:
    """Run the groups, write ``out_dir/model.json`` and return its content."""
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    init_distributed(ParallelDims(), seed=0)  # Megatron's layers need its (1-rank) groups
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    window = _window(batch, seq)
    shapes = SHAPES if shapes is None else shapes
    with threads(THREADS):
        step = {
            name: step_group(words, window, reps, warmup, old_impl, new_impl)
            for name, words in shapes.items()
        }
        fixed = {
            name: fixed_cost_group(words, step[name], fixed_reps, warmup, new_impl)
            for name, words in shapes.items()
        }
        throughput = throughput_group(throughput_shape, window, reps, warmup, old_impl, new_impl)
    result = {
        "config": {
            "batch": batch,
            "seq": seq,
            "reps": reps,
            "warmup": warmup,
            "fixed_reps": fixed_reps,
            "threads": THREADS,
            "old_path": path_overrides("old", old_impl, new_impl),
            "new_path": path_overrides("new", old_impl, new_impl),
        },
        "step": step,
        "fixed_cost": fixed,
        "throughput": throughput,
    }
    (out_path / "model.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--old-impl", default="lean")
    parser.add_argument("--new-impl", default=None, help="default: the config's default")
    args = parser.parse_args(argv)
    result = run(args.out, reps=args.reps, old_impl=args.old_impl, new_impl=args.new_impl)
    for key in ("ratios", "ratios_cpu"):
        print(key, json.dumps({k: v[key] for k, v in result["step"].items()}, indent=2))
    calls = {
        k: {n: v["aten_calls"] for n, v in g["variants"].items()} for k, g in result["step"].items()
    }
    print("aten calls per step", json.dumps(calls, indent=2))
    print(json.dumps(result["throughput"]["ratios"], indent=2))


if __name__ == "__main__":
    main()
