"""Benchmark of the depth-attention ops: lean vs reference, and two-phase vs both.

Owns the depth-attention benchmark:

* forward+backward wall time of ``lean`` and ``reference`` measured side by side
  (interleaved, alternating order, median of several repetitions) and the bytes each saves
  for backward, counted with :class:`bench.saved_bytes.SavedTensorCounter` both
  in total and excluding the op's own inputs;
* one Block AttnRes block of ``S`` sublayers over ``n`` completed blocks (``two_phase``):
  the two-phase path (phase 1 for the S queries, phase 2 merging the partial block per
  sublayer) against the one-pass ops called per sublayer, forward + backward, and the bytes
  read per sublayer measured with :class:`bench.io_counter.OpBytesCounter`
  (the inputs of every aten op, in units of ``d`` = one token's hidden vector in float32),
  next to the paper's Table 1.

``run(out_dir)`` writes ``out_dir/depth_attention.json`` and returns the same dict.

Usage: ``python -m bench.depth_attention_bench --out DIR``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from attnres_dist.ops import get_depth_attention
from bench.saved_bytes import SavedTensorCounter
from bench.two_phase_block import block_io, block_timings

IMPLS = ("lean", "reference")
TARGET_EXTRA_BYTES_RATIO = 0.25
TARGET_TIME_RATIO = 1.1


def _make_inputs(n: int, tokens: int, dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    sources = [
        torch.randn(tokens, dim, generator=gen, dtype=dtype).requires_grad_() for _ in range(n)
    ]
    query = (0.1 * torch.randn(dim, generator=gen)).requires_grad_()
    gain = (1.0 + 0.1 * torch.randn(dim, generator=gen)).requires_grad_()
    grad_out = torch.randn(tokens, dim, generator=gen, dtype=dtype)
    return query, sources, gain, grad_out


def _fwd_bwd_seconds(impl: str, query, sources, gain, grad_out) -> float:
    fn = get_depth_attention(impl)
    start = time.perf_counter()
    out = fn(query, sources, gain)
    torch.autograd.grad(out, [query, gain, *sources], grad_out)
    return time.perf_counter() - start


def _saved_bytes(impl: str, query, sources, gain) -> dict:
    with SavedTensorCounter() as counter:
        out = get_depth_attention(impl)(query, sources, gain)
    result = {
        "total_bytes": counter.total_bytes(),
        "extra_bytes": counter.extra_bytes([query, gain, *sources]),
        "saved_tensors": len(counter.saved),
    }
    del out
    return result


def run(
    out_dir: str | Path,
    n: int = 9,
    tokens: int = 4096,
    dim: int = 512,
    reps: int = 15,
    warmup: int = 2,
    seed: int = 0,
    blocks: int = 8,
    block_sizes: tuple[int, ...] = (3, 6),
) -> dict:
    """Run the benchmark, write ``out_dir/depth_attention.json`` and return its content."""
    dtype = torch.float32
    query, sources, gain, grad_out = _make_inputs(n, tokens, dim, dtype, seed)
    args = (query, sources, gain, grad_out)

    for _ in range(warmup):
        for impl in IMPLS:
            _fwd_bwd_seconds(impl, *args)
    samples: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for rep in range(reps):
        # Alternate the order so neither impl always runs on a warmer cache.
        order = IMPLS if rep % 2 == 0 else IMPLS[::-1]
        for impl in order:
            samples[impl].append(_fwd_bwd_seconds(impl, *args))
    median_ms = {impl: 1e3 * statistics.median(samples[impl]) for impl in IMPLS}

    saved = {impl: _saved_bytes(impl, query, sources, gain) for impl in IMPLS}
    time_ratio = median_ms["lean"] / median_ms["reference"]
    total_ratio = saved["lean"]["total_bytes"] / saved["reference"]["total_bytes"]
    extra_ratio = saved["lean"]["extra_bytes"] / saved["reference"]["extra_bytes"]

    two_phase = {
        str(size): {
            "time": block_timings(blocks, size, tokens, dim, reps, warmup, seed),
            "io": block_io(blocks, size, min(tokens, 256), dim, seed),
        }
        for size in block_sizes
    }

    result = {
        "two_phase": two_phase,
        "config": {
            "n_sources": n,
            "completed_blocks": blocks,
            "tokens": tokens,
            "dim": dim,
            "dtype": str(dtype),
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "reps": reps,
            "warmup": warmup,
            "torch": torch.__version__,
        },
        "time_ms": {
            impl: {
                "median": median_ms[impl],
                "min": 1e3 * min(samples[impl]),
                "samples": [1e3 * s for s in samples[impl]],
            }
            for impl in IMPLS
        },
        "saved": saved,
        "ratios": {
            "time_lean_over_reference": time_ratio,
            "total_saved_bytes_lean_over_reference": total_ratio,
            "extra_saved_bytes_lean_over_reference": extra_ratio,
        },
        "targets": {
            "time_ratio_max": TARGET_TIME_RATIO,
            "extra_saved_bytes_ratio_max": TARGET_EXTRA_BYTES_RATIO,
            "time_ok": time_ratio <= TARGET_TIME_RATIO,
            "extra_saved_bytes_ok": extra_ratio <= TARGET_EXTRA_BYTES_RATIO,
        },
    }
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    (out_path / "depth_attention.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_table(result: dict) -> str:
    """Human-readable summary of a :func:`run` result."""
    mib = 1 / (1 << 20)
    rows = [f"{'impl':<10} {'fwd+bwd ms':>11} {'saved MiB':>10} {'extra MiB':>10}"]
    for impl in IMPLS:
        t, s = result["time_ms"][impl]["median"], result["saved"][impl]
        rows.append(
            f"{impl:<10} {t:>11.2f} {s['total_bytes'] * mib:>10.2f} {s['extra_bytes'] * mib:>10.2f}"
        )
    r = result["ratios"]
    rows.append(
        f"{'lean/ref':<10} {r['time_lean_over_reference']:>11.3f} "
        f"{r['total_saved_bytes_lean_over_reference']:>10.3f} "
        f"{r['extra_saved_bytes_lean_over_reference']:>10.4f}"
    )
    for size, block in result["two_phase"].items():
        t, io = block["time"], block["io"]
        rows.append(
            f"S={size}: two-phase/lean {t['two_phase_over_lean']:.3f}, two-phase/reference "
            f"{t['two_phase_over_reference']:.3f}; reads per sublayer (d): "
            + ", ".join(f"{k} {v['read_d']:.1f}" for k, v in io["paths"].items())
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for depth_attention.json")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n", type=int, default=9)
    args = parser.parse_args(argv)
    result = run(args.out, n=args.n, tokens=args.tokens, dim=args.dim, reps=args.reps)
    print(format_table(result))
    print(f"wrote {Path(args.out) / 'depth_attention.json'}")


if __name__ == "__main__":
    main()
