"""``make bench``: run every benchmark and write ``DIR/summary.md`` with every ratio.

Runs the depth-attention op benchmark (``depth_attention_bench``, in this process), the
pipeline benchmark (``pipeline_bench``, a 2-rank torchrun job), the precision benchmark
(``precision_bench``: fp32 vs DeepSpeed's bf16 engine vs ZeRO-1 at dp = 2, a 2-rank job), the
model benchmark
(``model_bench``, in this process: AttnRes / baseline step time at three shapes, old path vs
new, and what AttnRes's extra time is made of: ``extra_time``; tokens/s against a
plain-PyTorch GPT), the generation benchmark (``generation_bench``,
in this process) and the RMSNorm benchmark (``norm_bench``: the C kernel against torch's, and the
fused merge + norm against the two kernels composed) and the core binding benchmark
(``binding_bench``: a pp = 2 step with each rank on its own cores vs on the scheduler's,
alternating 2-rank jobs) and the compile benchmark (``compile_bench``, in this process:
graphs, graph breaks, recompiles and compile time of ``runtime.compile: layer`` per residual
mode, its step time and aten ops per step against eager) and the host benchmark
(``host_bench``, in this process: host time and aten ops per training step at almost no
arithmetic, ours on DeepSpeed's bf16 engine against a plain-PyTorch GPT, eager and compiled)
and the MoE benchmark (``moe_bench``, a 2-rank job at dp = ep = 2: MoE Block / MoE baseline
step time, and the dispatcher's collectives' share of a step);
the model and generation benchmarks open a one-process group. Each writes its own JSON into
``DIR``. The summary lists each ratio with what it compares, and the
per-boundary bytes predicted by the activation contract next to the bytes measured on the wire.

Usage: ``python -m bench.run --out DIR [--quick]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import (
    binding_bench,
    compile_bench,
    depth_attention_bench,
    generation_bench,
    host_bench,
    model_bench,
    moe_bench,
    norm_bench,
    pipeline_bench,
    precision_bench,
)
from bench.extra_time import fixed_cost_rows, kernel_rows, pipeline_kernel_rows


def _stage_ms(variants: dict, name: str, stage: int, kind: str = "backward") -> str:
    rows = [r for r in variants[name]["stages"] if r["stage"] == stage]
    return f"{rows[0][f'{kind}_ms']:.1f}"


def _bounds(interval: tuple[float, float, float]) -> str:
    """A ``paired_interval``'s bounds, as the summary writes them."""
    return f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def _interval_text(pipe: dict) -> str:
    """The paired ratio's confidence interval, as the summary's words for it."""
    interval = pipe.get("step_time_block_over_baseline_interval")
    if interval is None:
        return " (too few repetitions for an interval)"
    return f"; {interval[2]:.0%} within {_bounds(interval)}"


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
        if "fused_over_two_phase" in t:
            rows.append(
                f"| depth attention time, fused C kernels / two-phase torch ops (S = {size}) | "
                f"{t['fused_over_two_phase']:.3f} | the same block: "
                f"{ms['two_phase_fused']:.1f} ms vs {ms['two_phase']:.1f} ms; "
                f"fused / lean {t['fused_over_lean']:.3f} |"
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


def _model_rows(model: dict) -> list[str]:
    """AttnRes / baseline per shape (old path beside new) and tokens/s against plain PyTorch."""
    c = model["config"]
    lines = [
        "",
        "## AttnRes step time over baseline, single process: new path (old path)",
        "",
        f"Forward + backward + AdamW on {c['batch']} x {c['seq']} tokens, {c['threads']} "
        f"threads. New: `{' '.join(c['new_path'])}`; old: `{' '.join(c['old_path'])}`; each "
        "path's baseline has its core attention.",
        "",
        "| shape | Block / baseline | Full / baseline | Block new / old | Full new / old | "
        "baseline new / old |",
        "|---|---|---|---|---|---|",
    ]
    for shape, group in model["step"].items():
        r = group["ratios"]
        lines.append(
            f"| {shape} | {r['block_over_baseline_new']:.3f} ({r['block_over_baseline_old']:.3f}) "
            f"| {r['full_over_baseline_new']:.3f} ({r['full_over_baseline_old']:.3f}) "
            f"| {r['block_new_over_old']:.3f} | {r['full_new_over_old']:.3f} "
            f"| {r['baseline_new_over_old']:.3f} |"
        )
    delta = ", ".join(
        f"{shape} {g['ratios']['delta_block_over_baseline_new']:.3f} / "
        f"{g['ratios']['delta_full_over_baseline_new']:.3f}"
        for shape, g in model["step"].items()
    )
    lines += ["", f"Delta Block / baseline and Delta Full / baseline, new path: {delta}."]
    intervals, coverage = [], None
    for shape, group in model["step"].items():
        within = group["ratio_intervals"]
        block, full = within["block_over_baseline_new"], within["full_over_baseline_new"]
        if block is not None and full is not None:  # None below 6 repetitions
            intervals.append(f"{shape}: Block {_bounds(block)}, Full {_bounds(full)}")
            coverage = block[2]  # the same at every shape: it depends on the repetitions only
    if intervals:
        lines += ["", f"Their {coverage:.0%} intervals, new path: {'; '.join(intervals)}."]
    lines += [
        "",
        "The same ratios in CPU time (the process's, all threads), and the aten calls of one "
        "step (views included):",
        "",
        "| shape | Block / baseline (CPU) | Full / baseline (CPU) | aten calls: baseline, "
        "Block, Full, new path (old path) |",
        "|---|---|---|---|",
    ]
    for shape, group in model["step"].items():
        r, v = group["ratios_cpu"], group["variants"]
        calls = ", ".join(
            f"{v[f'{m}_new']['aten_calls']:,} ({v[f'{m}_old']['aten_calls']:,})"
            for m in model_bench.MODES
        )
        lines.append(
            f"| {shape} | {r['block_over_baseline_new']:.3f} ({r['block_over_baseline_old']:.3f}) "
            f"| {r['full_over_baseline_new']:.3f} ({r['full_over_baseline_old']:.3f}) | {calls} |"
        )
    lines += fixed_cost_rows(model) + kernel_rows(model)
    t = model["throughput"]
    v, r = t["variants"], t["ratios"]
    lines += [
        "",
        "## Tokens/s: `make train-single`'s model vs a plain-PyTorch GPT of the same shape",
        "",
        "| model | tokens/s | / plain |",
        "|---|---|---|",
        f"| {v['attnres_new']['model']} (new path) | {v['attnres_new']['tokens_per_s']:,.0f} | "
        f"{r['attnres_new_over_plain']:.3f} (floor {t['floor_attnres_over_plain']}) |",
        f"| {v['attnres_old']['model']} (old path) | {v['attnres_old']['tokens_per_s']:,.0f} | "
        f"{r['attnres_old_over_plain']:.3f} |",
        f"| {v['baseline_new']['model']} | {v['baseline_new']['tokens_per_s']:,.0f} | "
        f"{r['baseline_new_over_plain']:.3f} |",
        f"| {v['plain']['model']} | {v['plain']['tokens_per_s']:,.0f} | 1 |",
    ]
    return lines


def _memory_rows(pipe: dict) -> list[str]:
    v = pipe["variants"]
    method = v["block_packed"]["memory"][0]["method"]
    lines = [
        "",
        f"## Peak memory per pipeline stage during one training step (pp = 2; {method})",
        "",
        "| variant | path | "
        + " | ".join(f"stage {m['stage']} MB" for m in v["baseline"]["memory"])
        + " |",
        "|---|---|" + "---|" * len(v["baseline"]["memory"]),
    ]
    for name, x in v.items():
        mem = sorted(x["memory"], key=lambda m: m["stage"])
        cells = " | ".join(f"{m['peak_bytes'] / 2**20:.1f}" for m in mem)
        lines.append(f"| {name} | {x['path']} | {cells} |")
    return lines


def precision_markdown(prec: dict) -> list[str]:
    v, r = prec["variants"], prec["ratios"]
    return [
        "",
        "## Precision and ZeRO-1 at dp = 2: memory per rank and step time",
        "",
        "Model + optimizer state per rank: the bytes of every tensor an engine holds for "
        "parameters, gradients, DeepSpeed's flat buffers, master weights and AdamW state, at "
        "the optimizer step (activations, which bf16 also halves, are not counted). "
        f"Device: {prec['config']['device']}.",
        "",
        precision_bench.format_table(prec),
        "",
        "| ratio | value |",
        "|---|---|",
        *(f"| {name.replace('_', ' ')} | {value:.3f} |" for name, value in r.items()),
        "",
        f"Parameters per rank: {v['fp32']['parameters_per_rank']:,}.",
    ]


def summary_markdown(
    depth: dict,
    pipe: dict,
    gen: dict | None = None,
    model: dict | None = None,
    prec: dict | None = None,
    norm: dict | None = None,
    binding: dict | None = None,
    compiled: dict | None = None,
) -> str:
    r, p = depth["ratios"], pipe["ratios"]
    v = pipe["variants"]
    ms = {name: x["step_s"]["median"] * 1e3 for name, x in v.items()}
    dc = depth["config"]
    lines = [
        "# Benchmarks",
        "",
        "Every timing is a median over interleaved repetitions (alternating order), measured "
        "side by side in one run; the machine is shared, so ratios matter more than absolute "
        "times. The step-time ratios of the model and pipeline benches are paired: the median "
        "over repetitions of the two steps' ratio within one repetition "
        "(`bench/paired.py`); `ratios_of_medians` in their JSON has the ratio of "
        "the medians beside it.",
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
        f"{p['step_time_block_over_baseline']:.3f} | pp = 2, new path: {ms['block_packed']:.1f} "
        f"ms vs {ms['baseline']:.1f} ms{_interval_text(pipe)} |",
        f"| stage {pipe['bottleneck_stage']} compute per micro-batch, Block AttnRes / baseline "
        f"| {p['bottleneck_stage_compute_block_over_baseline']:.3f} | pp = 2, new path: the "
        f"slowest stage's forward + backward, without the waits |",
        *pipeline_kernel_rows(pipe),
        f"| pipeline step time, Block AttnRes / baseline, old path | "
        f"{p['step_time_block_over_baseline_old']:.3f} | pp = 2: {ms['block_old']:.1f} ms vs "
        f"{ms['baseline_old']:.1f} ms |",
        f"| pipeline step time, Block AttnRes new / old path | "
        f"{p['step_time_block_new_over_old']:.3f} | pp = 2 |",
        *(binding_bench.markdown_rows(binding) if binding is not None else []),
        *(
            f"| stage {k[5]} peak memory, Block AttnRes new / old path | {p[k]:.3f} | "
            "one pp = 2 training step |"
            for k in sorted(p)
            if k.endswith("_peak_memory_block_new_over_old")
        ),
        *(generation_rows(gen) if gen is not None else []),
        *(norm_bench.markdown_rows(norm) if norm is not None else []),
        *([] if model is None else _model_rows(model)),
        *([] if compiled is None else compile_bench.markdown_rows(compiled)),
        *_memory_rows(pipe),
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
    if prec is not None:
        lines += precision_markdown(prec)
    return "\n".join(lines)


# --quick: the tiny default and a shallower deep-narrow shape, on fewer tokens
QUICK_SHAPES = {
    "4x128 S=2": model_bench.SHAPES["4x128 S=2"],
    "8x64 S=4": ("model.num_layers=8", "model.hidden_size=64", "model.attnres.block_size=4"),
}


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
        model = model_bench.run(out, shapes=QUICK_SHAPES, batch=4, seq=64, reps=2, warmup=1)
        prec = precision_bench.run(out, reps=2, warmup=1)
        gen = generation_bench.run(out, new=16, reps=1, warmup=0)
        norm = norm_bench.run(out, tokens=256, reps=3, warmup=1)
        binding = binding_bench.run(out, reps=2, warmup=1, rounds=1)
        compiled = compile_bench.run(out, backend="aot_eager", batch=2, seq=32, steps=3)
        host = host_bench.run(out, backend="aot_eager", reps=2, steps=2, warmup=1, floor_reps=6)
        moe = moe_bench.run(out, reps=2, warmup=1)
    else:
        depth = depth_attention_bench.run(out)
        pipe = pipeline_bench.run(out)
        prec = precision_bench.run(out)
        model = model_bench.run(out)
        gen = generation_bench.run(out)
        norm = norm_bench.run(out)
        binding = binding_bench.run(out)
        compiled = compile_bench.run(out)
        host = host_bench.run(out)
        moe = moe_bench.run(out)
    text = summary_markdown(depth, pipe, gen, model, prec, norm, binding, compiled)
    text += "\n".join(["", *host_bench.markdown(host), *moe_bench.markdown(moe)])
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
