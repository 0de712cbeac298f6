"""``make bench``: run every benchmark and write ``DIR/summary.md`` with every ratio.

Runs the depth-attention op benchmark (``depth_attention_bench``, in this process), the
pipeline benchmark (``pipeline_bench``, a 2-rank torchrun job) and the generation benchmark
(``generation_bench``, in this process, last: it opens a one-process group); each writes its
own JSON into ``DIR``. The summary lists each ratio with what it compares, and the
per-boundary bytes predicted by the activation contract next to the bytes measured on the wire.

Usage: ``python -m attnres_dist.bench.run --out DIR [--quick]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnres_dist.bench import depth_attention_bench, generation_bench, pipeline_bench


def _stage_ms(variants: dict, name: str, stage: int, kind: str = "backward") -> str:
    rows = [r for r in variants[name]["stages"] if r["stage"] == stage]
    return f"{rows[0][f'{kind}_ms']:.1f}"


def _two_phase_rows(depth: dict) -> list[str]:
    dc, rows = depth["config"], []
    for size, block in depth.get("two_phase", {}).items():
        t = block["time"]
        ms = t["median_ms"]
        rows.append(
            f"| depth attention time, two-phase / lean (S = {size}) | "
            f"{t['two_phase_over_lean']:.3f} | one block of {size} sublayers over "
            f"{dc['completed_blocks']} completed blocks, forward + backward, {dc['tokens']} "
            f"tokens x {dc['dim']}: {ms['two_phase']:.1f} ms vs {ms['lean']:.1f} ms "
            "(CPU time, one thread) |"
        )
        rows.append(
            f"| depth attention time, two-phase / reference (S = {size}) | "
            f"{t['two_phase_over_reference']:.3f} | the same block: {ms['two_phase']:.1f} ms vs "
            f"{ms['reference']:.1f} ms |"
        )
    return rows


def _io_table(depth: dict) -> list[str]:
    blocks = depth.get("two_phase", {})
    if not blocks:
        return []
    first = next(iter(blocks.values()))["io"]
    lines = [
        "",
        "## Bytes per sublayer and token, measured, next to the paper's Table 1",
        "",
        f"Measured: {first['method']} ({first['tokens']} tokens, "
        f"{depth['config']['completed_blocks']} completed blocks; d = one token's hidden "
        "vector in float32). The paper counts a fused kernel's reads + writes; these are an "
        "unfused execution's.",
        "",
        "| path | S | read (d) | written (d) | read + written (d) | paper Table 1 (d) | "
        "backward read (d) |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, block in blocks.items():
        for name, v in block["io"]["paths"].items():
            paper = "" if v["paper_table1_d"] is None else f"{v['paper_table1_d']:.2f}"
            lines.append(
                f"| {name} | {size} | {v['read_d']:.2f} | {v['written_d']:.2f} | "
                f"{v['read_d'] + v['written_d']:.2f} | {paper} | {v['backward_read_d']:.2f} |"
            )
    return lines


def generation_rows(gen: dict) -> list[str]:
    c, t, r = gen["config"], gen["tokens_per_s"], gen["ratios"]
    same = "same greedy tokens" if gen["greedy_tokens_equal"] else "**greedy tokens differ**"
    return [
        f"| generation tokens/s, KV cache / recompute | {r['cached_over_recompute']:.2f} | "
        f"{c['new_tokens']} new tokens after a {c['prompt_tokens']}-token prompt, "
        f"{c['model']}: {t['cached']:.0f} tokens/s cached vs {t['recompute']:.0f} recomputing "
        f"the window (AttnResGPT); {same} |",
        f"| generation tokens/s, KV cache / HF recompute | "
        f"{r['cached_over_hf_recompute']:.2f} | the exported model with and "
        f"without its cache ({t['hf_recompute']:.0f} tokens/s without) |",
    ]


def summary_markdown(depth: dict, pipe: dict, gen: dict | None = None) -> str:
    r, p = depth["ratios"], pipe["ratios"]
    v = pipe["variants"]
    ms = {name: x["step_s"]["median"] * 1e3 for name, x in v.items()}
    dc = depth["config"]
    lines = [
        "# Benchmarks",
        "",
        "Every timing is a median over interleaved repetitions (alternating order), measured "
        "side by side in one run; the machine is shared, so ratios matter more than absolute "
        "times.",
        "",
        "| ratio | value | compares |",
        "|---|---|---|",
        f"| depth attention time, lean / reference | {r['time_lean_over_reference']:.3f} | "
        f"forward + backward, n = {dc['n_sources']} sources, {dc['tokens']} tokens x "
        f"{dc['dim']} (target <= {depth['targets']['time_ratio_max']}) |",
        f"| depth attention saved bytes, lean / reference | "
        f"{r['total_saved_bytes_lean_over_reference']:.3f} | all tensors saved for backward |",
        f"| depth attention extra saved bytes, lean / reference | "
        f"{r['extra_saved_bytes_lean_over_reference']:.4f} | saved beyond the op's inputs "
        f"(target <= {depth['targets']['extra_saved_bytes_ratio_max']}) |",
        *_two_phase_rows(depth),
        f"| pipeline step time, packed / tuple payload | "
        f"{p['step_time_packed_over_tuple']:.3f} | Block AttnRes at pp = 2: "
        f"{ms['block_packed']:.1f} ms packed vs {ms['block_tuple']:.1f} ms tuple |",
        f"| stage 0 backward per micro-batch, packed / tuple | "
        f"{p['stage0_backward_packed_over_tuple']:.3f} | the sending stage, where a tuple's "
        f"k = {v['block_tuple']['wire'][0]['k']} backward traversals run: "
        f"{_stage_ms(v, 'block_packed', 0)} ms vs {_stage_ms(v, 'block_tuple', 0)} ms |",
        f"| pipeline step time, Block AttnRes / baseline | "
        f"{p['step_time_block_over_baseline']:.3f} | pp = 2: {ms['block_packed']:.1f} ms vs "
        f"{ms['baseline']:.1f} ms |",
        *(generation_rows(gen) if gen is not None else []),
        "",
        "## Bytes per boundary and micro-batch: contract prediction vs DeepSpeed's wire",
        "",
        "Wire bytes: every tensor DeepSpeed's p2p layer sends or receives, per micro-batch "
        "(shape metadata, sent once, excluded). "
        + (
            "All equal the prediction."
            if pipe["wire_bytes_equal_prediction"]
            else "**Some differ from the prediction.**"
        ),
        "",
        "| variant | model | boundary | direction | k | predicted | wire | wire messages | equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in v.items():
        for row in x["wire"]:
            wire = ", ".join(f"{b:,}" for b in row["measured"]) or "none"
            lines.append(
                f"| {name} | {x['model']} | {row['boundary']} | {row['direction']} | {row['k']} "
                f"| {row['predicted']:,} | {wire} | "
                f"{', '.join(map(str, row['messages']))} | {'yes' if row['equal'] else 'NO'} |"
            )
    lines += _io_table(depth)
    cfg = pipe["config"]
    lines += [
        "",
        f"Pipeline bench: `{' '.join([cfg['path'], *cfg['overrides']])}`, {cfg['reps']} "
        f"repetitions after {cfg['warmup']} warm-up, {cfg['threads_per_rank']} thread(s) per "
        "rank; step time = the slowest rank's, each step started after a barrier.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--quick", action="store_true", help="fewer repetitions (a smoke run, not a measurement)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.quick:
        depth = depth_attention_bench.run(out, tokens=1024, dim=128, reps=3, warmup=1)
        pipe = pipeline_bench.run(out, reps=2, warmup=1)
        gen = generation_bench.run(out, new=16, reps=1, warmup=0)
    else:
        depth = depth_attention_bench.run(out)
        pipe = pipeline_bench.run(out)
        gen = generation_bench.run(out)
    text = summary_markdown(depth, pipe, gen)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
