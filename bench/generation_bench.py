"""Benchmark of generation: KV-cached decoding against recomputing the window per token.

One model (``configs/tiny.yaml``'s: 4 layers x 128, Block AttnRes S = 2, tied head, random
weights, every depth-attention query non-zero) with a window of ``prompt + new`` tokens, so
every path sees the whole sequence at every step and greedy decoding must give the same
tokens on all of them (checked; the end-of-document token does not stop the runs, so each
produces exactly ``new`` tokens). Paths, timed interleaved in alternating order, median of
``reps``, on one intra-op thread (two threads on a shared 2-core machine made single-token
forwards erratic):

* ``recompute``: ``AttnResGPT`` (Megatron-Core layers) over the whole window for every token,
  the way ``attnres-dist generate`` decoded before it had a cache;
* ``hf_recompute``: the exported Hugging Face model, the same recomputation without a cache;
* ``cached``: the exported model with a transformers ``DynamicCache`` (one prompt forward, then
  one position per token), what ``attnres-dist generate`` does now.

``run(out_dir)`` writes ``out_dir/generation.json`` and returns the same dict.

Usage: ``python -m bench.generation_bench --out DIR [--quick]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from attnres_dist import generation

PATHS = ("recompute", "hf_recompute", "cached")


def _models(prompt: int, new: int, overrides: tuple[str, ...]):
    from attnres_dist.config import load_config
    from attnres_dist.hf import writer
    from attnres_dist.model.gpt import AttnResGPT, ModelBuilder
    from attnres_dist.parallel.dims import ParallelDims
    from attnres_dist.parallel.process_groups import init_distributed

    cfg = load_config("configs/tiny.yaml", [f"model.seq_length={prompt + new}", *overrides])
    init_distributed(ParallelDims(), seed=0)
    native = AttnResGPT(ModelBuilder(cfg.model, 257, seed=1)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in native.named_parameters():
            if name.endswith("query"):
                p.copy_(torch.randn(p.shape, generator=g))
    padded = native.embedding.word_embeddings.weight.shape[0]
    tensors = {k: v for k, v in native.state_dict().items() if not k.endswith("_extra_state")}
    config = writer.hf_config(cfg.model, 257, padded, 256, {})
    return cfg, native, writer.hf_model(tensors, config)


def _decoder(path: str, native, hf, window: int):
    if path == "recompute":
        return generation.RecomputeWindow(generation.native_forward(native), window, "cpu")
    if path == "hf_recompute":
        return generation.RecomputeWindow(generation.hf_forward(hf), window, "cpu")
    return generation.CachedDecoder(hf, window)


def run(
    out_dir,
    prompt: int = 64,
    new: int = 256,
    reps: int = 3,
    warmup: int = 1,
    overrides: tuple[str, ...] = (),
) -> dict:
    import torch.distributed as dist

    from attnres_dist.parallel.process_groups import shutdown_distributed

    ours = not dist.is_initialized()  # close only the one-process group this run opens
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg, native, hf = _models(prompt, new, overrides)
    text = Path(__file__).read_bytes()
    ids = list((text * (prompt // len(text) + 1))[:prompt])
    window = prompt + new
    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    tokens: dict[str, list[int]] = {}
    try:
        for rep in range(warmup + reps):
            order = PATHS if rep % 2 == 0 else PATHS[::-1]
            for path in order:
                decoder = _decoder(path, native, hf, window)
                start = time.perf_counter()
                out = generation.sample(decoder, ids, 257, -1, new, temperature=0)
                elapsed = time.perf_counter() - start
                if rep >= warmup:
                    seconds[path].append(elapsed)
                tokens[path] = out
    finally:
        if ours:
            shutdown_distributed()
        torch.set_num_threads(threads)
    median = {p: statistics.median(s) for p, s in seconds.items()}
    per_s = {p: new / median[p] for p in PATHS}
    result = {
        "config": {
            "model": f"{cfg.model.num_layers} x {cfg.model.hidden_size}, "
            f"{cfg.model.block_plan().describe()}",
            "prompt_tokens": prompt,
            "new_tokens": new,
            "reps": reps,
            "warmup": warmup,
            "threads": 1,
            "overrides": list(overrides),
        },
        "seconds": {p: sorted(s) for p, s in seconds.items()},
        "tokens_per_s": per_s,
        "ratios": {
            "cached_over_recompute": per_s["cached"] / per_s["recompute"],
            "cached_over_hf_recompute": per_s["cached"] / per_s["hf_recompute"],
        },
        "greedy_tokens_equal": tokens["cached"] == tokens["recompute"] == tokens["hf_recompute"],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "generation.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="16 new tokens, one repetition")
    args = parser.parse_args(argv)
    kwargs = {"new": 16, "reps": 1, "warmup": 0} if args.quick else {}
    print(json.dumps(run(args.out, **kwargs), indent=2))


if __name__ == "__main__":
    main()
