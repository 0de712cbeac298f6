"""GPU benchmark of the depth-attention implementations at one block's shapes.

For every implementation available here among ``reference``, ``lean``, ``twophase``,
``triton``, ``fla`` and ``flash_attn_res`` (an unregistered or unusable one is listed with its
reason), it measures the depth attention of one block of ``S`` sublayers: each sublayer attends
over 8 completed blocks (one contiguous store ``[8, T, D]``) plus the partial block. A
two-phase implementation runs phase 1 once for the ``S`` queries and phase 2 per sublayer; a
one-pass one runs ``S`` calls over the store's rows plus the partial block. Per shape (S in
{3, 6}, T in {4096, 16384} tokens, D in {512, 1024, 2048}, bfloat16 and float32) it records
the median forward and forward + backward time (CUDA events), the peak CUDA memory beyond the
inputs, and the largest output difference from ``reference`` on the same inputs.

``run(out_dir)`` writes ``out_dir/kernel_bench.json`` and returns the same dict. With
``dry_run=True`` (or on a machine without CUDA) the same code runs on the CPU at tiny shapes,
Triton kernels through its interpreter, so CI can smoke it; its times mean nothing.

Usage: ``python -m bench.kernel_bench --out DIR [--dry-run]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from attnres_dist.ops import available_depth_attention_impls, get_depth_attention

IMPLS = ("reference", "lean", "twophase", "triton", "fla", "flash_attn_res")
N_BLOCKS = 8
EPS = 1e-6
# The op-level shape first, then the largest bf16 one (at 4096 x 512 an H200 is bound
# by launches, not bytes: 3.4 ms for what its bandwidth moves in under 0.1 ms), so a run cut
# short by its time budget has both. On an H200 each new shape costs fla ~35 s and
# flash-attn-res ~20 s of autotuning at its first call.
_ALL_SHAPES = [
    (s, t, d, dt)
    for t in (4096, 16384)
    for d in (512, 1024, 2048)
    for dt in ("bfloat16", "float32")
    for s in (3, 6)
]
_FIRST = [(3, 4096, 512, "bfloat16"), (3, 16384, 2048, "bfloat16")]
GPU_SHAPES = _FIRST + [shape for shape in _ALL_SHAPES if shape not in _FIRST]
DRY_SHAPES = [(3, 12, 32, "float32"), (3, 12, 32, "bfloat16")]


def impl_status(names=IMPLS) -> dict[str, str | None]:
    """``name -> None`` for the implementations that run here, else why not."""
    registered = set(available_depth_attention_impls())
    status = {}
    for name in names:
        if name not in registered:
            status[name] = "not registered"
            continue
        status[name] = get_depth_attention(name).requirement()
    return status


def make_inputs(num_q: int, tokens: int, dim: int, dtype: torch.dtype, device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    store = torch.randn(N_BLOCKS, tokens, dim, generator=gen).to(device=device, dtype=dtype)
    partial = torch.randn(tokens, dim, generator=gen).to(device=device, dtype=dtype)
    queries = (0.05 * torch.randn(num_q, dim, generator=gen)).to(device)
    gains = (1.0 + 0.1 * torch.randn(num_q, dim, generator=gen)).to(device)
    grad = torch.randn(tokens, dim, generator=gen).to(device=device, dtype=dtype)
    return store, partial, queries, gains, grad


def block_attention(impl, store, partial, queries, gains) -> list[torch.Tensor]:
    """One block's depth attention: S sublayers over the store plus the partial block."""
    num_q = queries.shape[0]
    if impl.two_phase:
        weights = torch.stack((queries, gains), 1)  # [S, 2, D], as the model packs them
        out1, lse = impl.phase1(store, weights, EPS)
        extra = partial[None]
        return [impl.phase2(out1[i], lse[i], extra, weights[i], EPS) for i in range(num_q)]
    sources = [*store.unbind(0), partial]
    return [impl(queries[i], sources, gains[i], eps=EPS) for i in range(num_q)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(start, end) -> float:
    if isinstance(start, float):
        return 1e3 * (end - start)
    return start.elapsed_time(end)


def _step(impl, inputs, device):
    store, partial, queries, gains, grad = inputs
    leaves = [t.detach().requires_grad_() for t in (store, partial, queries, gains)]
    t0 = _clock(device)
    outs = block_attention(impl, *leaves)
    t1 = _clock(device)
    torch.autograd.grad(outs, leaves, [grad] * len(outs))
    t2 = _clock(device)
    del outs  # before the next repetition, so the peak holds one step's tensors
    _sync(device)
    return _elapsed_ms(t0, t1), _elapsed_ms(t0, t2)


def measure(impl, inputs, device, reps: int, warmup: int) -> dict:
    """Median forward and forward + backward milliseconds and the peak memory beyond inputs."""
    first_call_s = None  # the first call's wall time: JIT compilation and autotuning
    for i in range(warmup):
        t0 = time.perf_counter()
        _step(impl, inputs, device)
        if i == 0:
            first_call_s = time.perf_counter() - t0
    peak = None
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    fwd, total = [], []
    for _ in range(reps):
        f, t = _step(impl, inputs, device)
        fwd.append(f)
        total.append(t)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    return {
        "forward_ms": statistics.median(fwd),
        "fwd_bwd_ms": statistics.median(total),
        "peak_extra_mib": None if peak is None else peak / (1 << 20),
        "first_call_s": first_call_s,
    }


@contextmanager
def _interpreter(enabled: bool):
    old = os.environ.get("TRITON_INTERPRET")
    if enabled:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if enabled:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for module in ("triton", "fla", "flash_attn_res"):
        try:
            from importlib.metadata import version

            dist = {"fla": "fla-core", "flash_attn_res": "flash-attn-res"}.get(module, module)
            out[module] = version(dist)
        except Exception:
            out[module] = None
    return out


def run(
    out_dir: str | Path,
    dry_run: bool = False,
    reps: int = 5,
    warmup: int = 2,
    time_budget_s: float = 180.0,
    impls=IMPLS,
) -> dict:
    """Benchmark every available implementation; write ``out_dir/kernel_bench.json``."""
    dry_run = dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry_run else "cuda")
    shapes = DRY_SHAPES if dry_run else GPU_SHAPES
    if dry_run:
        reps, warmup = 1, 0
    start = time.perf_counter()
    with _interpreter(dry_run):
        status = impl_status(impls)
        usable = [name for name, why in status.items() if why is None]
        results = []
        for num_q, tokens, dim, dtype_name in shapes:
            shape = {"S": num_q, "tokens": tokens, "dim": dim, "dtype": dtype_name}
            if time.perf_counter() - start > time_budget_s:
                results.append({**shape, "skipped": f"time budget of {time_budget_s:.0f} s spent"})
                continue
            inputs = make_inputs(num_q, tokens, dim, getattr(torch, dtype_name), device)
            with torch.no_grad():
                ref = block_attention(get_depth_attention("reference"), *inputs[:4])
            for name in usable:
                row = {**shape, "impl": name}
                if time.perf_counter() - start > time_budget_s:
                    spent = f"time budget of {time_budget_s:.0f} s spent"
                    results.append({**row, "skipped": spent})
                    continue
                try:
                    row.update(measure(get_depth_attention(name), inputs, device, reps, warmup))
                    with torch.no_grad():
                        outs = block_attention(get_depth_attention(name), *inputs[:4])
                    row["max_abs_err_vs_reference"] = max(
                        (o.float() - r.float()).abs().max().item()
                        for o, r in zip(outs, ref, strict=True)
                    )
                except Exception as exc:  # one failing kernel must not end the whole check
                    row["error"] = _first_line(exc)
                results.append(row)
                print(f"kernel_bench {json.dumps(row, default=str)}", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del inputs, ref
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": dry_run,
        "n_blocks": N_BLOCKS,
        "reps": reps,
        "warmup": warmup,
        "versions": _versions(),
        "impls": status,
        "results": results,
        "ratios_vs_lean": _ratios(results),
        "wall_s": time.perf_counter() - start,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _key(row: dict) -> str:
    return f"S={row['S']} T={row['tokens']} D={row['dim']} {row['dtype']}"


def _ratios(results: list[dict]) -> dict:
    """Per shape: each implementation's forward + backward time over the lean op's."""
    lean = {
        _key(r): r["fwd_bwd_ms"] for r in results if r.get("impl") == "lean" and "fwd_bwd_ms" in r
    }
    ratios: dict[str, dict[str, float]] = {}
    for r in results:
        if "fwd_bwd_ms" in r and _key(r) in lean and r["impl"] != "lean":
            ratios.setdefault(_key(r), {})[r["impl"]] = r["fwd_bwd_ms"] / lean[_key(r)]
    return ratios


def markdown_table(result: dict) -> str:
    """A table of every measured row (for docs/gpu.md)."""
    lines = [
        f"Depth attention of one block (S sublayers over {result['n_blocks']} completed blocks "
        f"plus the partial block), {result['device']}, median of {result['reps']}:",
        "",
        "| S | tokens | D | dtype | impl | fwd ms | fwd+bwd ms | peak extra MiB | max err vs ref |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        head = f"| {r['S']} | {r['tokens']} | {r['dim']} | {r['dtype']} | {r.get('impl', '-')} |"
        if "fwd_bwd_ms" in r:
            mem = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}"
            lines.append(
                f"{head} {r['forward_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {mem} | "
                f"{r['max_abs_err_vs_reference']:.2e} |"
            )
        else:
            lines.append(f"{head} {r.get('error') or r.get('skipped')} | | | |")
    skipped = {k: v for k, v in result["impls"].items() if v is not None}
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"`{k}`: {v}" for k, v in skipped.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for kernel_bench.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--time-budget", type=float, default=180.0, help="seconds")
    args = parser.parse_args(argv)
    result = run(args.out, dry_run=args.dry_run, reps=args.reps, time_budget_s=args.time_budget)
    print(markdown_table(result))
    print(f"wrote {Path(args.out) / 'kernel_bench.json'}")


if __name__ == "__main__":
    main()
