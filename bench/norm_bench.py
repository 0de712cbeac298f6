"""RMSNorm benchmark (one process): the fused C kernel against torch's CPU ``rms_norm``, and
Block AttnRes's phase-2 merge with the RMSNorm after it fused into one kernel against the two
kernels composed.

Forward + backward of one RMSNorm over ``[tokens, D]`` float32 (the gradient reaching the input
and the gain, as in a layer), at the hidden sizes of ``model_bench``'s shapes, the two
implementations interleaved (the order alternates each repetition) and the median taken, with
the process's threads set as in the model benchmark. Each also records its largest difference
from the definition computed in float64 (relative to each result's largest magnitude). The
merge + norm pair is timed the same way (forward + backward, gradients of all six inputs).
Skipped, with the reason, where the C kernels cannot be built.

``run(out_dir)`` writes ``out_dir/norm.json`` and returns it.
Usage: ``python -m bench.norm_bench --out DIR``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.model_bench import THREADS, threads

DIMS = (64, 128)


def _forward_backward(norm, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> None:
    torch.autograd.grad(norm(x, w), (x, w), grad)


def _error(norm, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> float:
    """Largest difference of the output and both gradients from the float64 definition, each
    relative to its tensor's largest magnitude (the gain's gradient is a sum over tokens)."""
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5) * w64
    wants = (want, *torch.autograd.grad(want, (x64, w64), grad.double()))
    got = norm(x, w)
    gots = (got, *torch.autograd.grad(got, (x, w), grad))
    pairs = zip(gots, wants, strict=True)
    return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in pairs)


def _interleaved(fns: dict, reps: int, warmup: int) -> dict[str, float]:
    """Median seconds of each zero-argument function, run alternately (the order flips)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(warmup + reps):
        for name in list(fns)[:: 1 if rep % 2 else -1]:
            start = time.perf_counter()
            fns[name]()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _merge_norm(dim: int, tokens: int, reps: int, warmup: int, gen) -> dict:
    """Fused merge + RMSNorm against phase 2 then RMSNorm (both the C kernels), 3 blocks."""
    from attnres_dist.ops import cpu_two_phase
    from attnres_dist.ops.cpu_rms_norm import rms_norm
    from attnres_dist.ops.cpu_two_phase import merge_rms_norm

    blocks = torch.randn(3, tokens, dim, generator=gen)
    q, g, w = (1 + 0.3 * torch.randn(3, dim, generator=gen)).unbind(0)
    out1, lse = cpu_two_phase.phase1(blocks, torch.stack((q, g))[None])
    leaves = [t.detach().requires_grad_() for t in (out1[0], lse[0])]
    extra = torch.randn(1, tokens, dim, generator=gen).requires_grad_()
    leaves += [extra, *(t.requires_grad_() for t in (q, g, w))]
    grad = torch.randn(tokens, dim, generator=gen)

    def fused():
        weights = torch.stack(leaves[3:5])
        torch.autograd.grad(merge_rms_norm(*leaves[:3], weights, leaves[5]), leaves, grad)

    def composed():
        mixed = cpu_two_phase.phase2(*leaves[:3], torch.stack(leaves[3:5]))
        torch.autograd.grad(rms_norm(mixed, leaves[5], 1e-5), leaves, grad)

    med = _interleaved({"fused": fused, "composed": composed}, reps, warmup)
    return {
        "median_us": {name: m * 1e6 for name, m in med.items()},
        "fused_over_composed": med["fused"] / med["composed"],
    }


def run(out_dir: str | Path, tokens: int = 2048, reps: int = 51, warmup: int = 5) -> dict:
    from attnres_dist.ops.cpu_rms_norm import requirement, rms_norm

    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    result: dict = {"config": {"tokens": tokens, "reps": reps, "threads": THREADS}}
    if requirement() is not None:
        result["skipped"] = requirement()
    else:
        norms = {
            "torch": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5),
            "cpu": lambda x, w: rms_norm(x, w, 1e-5),
        }
        gen = torch.Generator().manual_seed(0)
        result["dims"] = {}
        with threads(THREADS):
            for dim in DIMS:
                x = torch.randn(tokens, dim, generator=gen).requires_grad_()
                w = (1 + 0.1 * torch.randn(dim, generator=gen)).requires_grad_()
                grad = torch.randn(tokens, dim, generator=gen)
                steps = {n: partial(_forward_backward, f, x, w, grad) for n, f in norms.items()}
                med = _interleaved(steps, reps, warmup)
                result["dims"][str(dim)] = {
                    "median_us": {name: m * 1e6 for name, m in med.items()},
                    "cpu_over_torch": med["cpu"] / med["torch"],
                    "max_error_vs_float64": {n: _error(f, x, w, grad) for n, f in norms.items()},
                    "merge_norm": _merge_norm(dim, tokens, reps, warmup, gen),
                }
    (out_path / "norm.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def markdown_rows(result: dict) -> list[str]:
    """Summary rows (``bench.run``)."""
    if "skipped" in result:
        return [f"| RMSNorm time, C kernel / torch | skipped | {result['skipped']} |"]
    c = result["config"]
    rows = []
    for dim, v in result["dims"].items():
        us, err = v["median_us"], v["max_error_vs_float64"]
        rows.append(
            f"| RMSNorm time, C kernel / torch (D = {dim}) | {v['cpu_over_torch']:.3f} | forward "
            f"+ backward, {c['tokens']} tokens, {c['threads']} threads: {us['cpu']:.0f} us vs "
            f"{us['torch']:.0f} us; largest relative difference from float64 {err['cpu']:.1e} vs "
            f"{err['torch']:.1e} |"
        )
        mn = v["merge_norm"]
        rows.append(
            f"| Block phase-2 merge + RMSNorm time, fused / composed (D = {dim}) | "
            f"{mn['fused_over_composed']:.3f} | forward + backward, one kernel vs the merge's "
            f"and the norm's: {mn['median_us']['fused']:.0f} us vs "
            f"{mn['median_us']['composed']:.0f} us |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    print("\n".join(markdown_rows(run(args.out))))


if __name__ == "__main__":
    main()
