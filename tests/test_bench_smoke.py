"""Smoke run of ``make bench``: it runs, the wire bytes equal the contract, every ratio exists.

One 2-rank job with a tiny model and one repetition, and the model benchmark at tiny shapes: a
check that the benchmarks work, that packed and tuple payloads put exactly the predicted bytes
on the wire, and that every ratio of the summary is there and positive; not a measurement.
"""

from __future__ import annotations

import os

import pytest

from attnres_dist.ops.cpu_library import requirement
from bench import (
    binding_bench,
    depth_attention_bench,
    generation_bench,
    model_bench,
    pipeline_bench,
    precision_bench,
)
from bench.extra_time import fixed_cost_rows, kernel_rows
from bench.peak_memory import peak_bytes
from bench.run import (
    generation_rows,
    precision_markdown,
    summary_markdown,
)
from tests.conftest import TINY_MODEL


@pytest.mark.slow
def test_binding_bench_smoke(small_dataset, tmp_path):
    result = binding_bench.run(
        tmp_path, overrides=(f"data.path={small_dataset}", *TINY_MODEL), reps=1, warmup=1, rounds=1
    )
    assert (tmp_path / "pipeline_binding.json").exists()
    assert set(result["variants"]) == {
        "block_bound", "block_unbound", "baseline_bound", "baseline_unbound"
    }  # fmt: skip
    assert all(r > 0 for r in result["ratios"].values())
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2 and len(cores) == os.cpu_count():  # the bound job's ranks split them
        half = len(cores) // 2
        assert result["config"]["cores"] == f"rank 0: cores {cores[:half]}; rank 1: cores " + str(
            cores[half : 2 * half]
        )
    rows = binding_bench.markdown_rows(result)
    assert len(rows) == 4 and all(row.startswith("| pipeline step time") for row in rows)


@pytest.mark.slow
def test_pipeline_bench_smoke(small_dataset, tmp_path):
    result = pipeline_bench.run(
        tmp_path, overrides=(f"data.path={small_dataset}", *TINY_MODEL), reps=1, warmup=1
    )
    assert (tmp_path / "pipeline.json").exists()
    assert result["wire_bytes_equal_prediction"]
    for name, variant in result["variants"].items():
        for row in variant["wire"]:
            assert row["measured"] == [row["predicted"]], (name, row)
            # packed: one message per micro-batch; tuple: one per block tensor
            assert row["messages"] == [row["k"] if variant["payload"] == "tuple" else 1]
        assert sorted(r["stage"] for r in variant["stages"]) == [0, 1]
        assert all(r["backward_ms"] > 0 for r in variant["stages"])
    block = result["variants"]["block_packed"]["wire"][0]
    assert block["k"] == 3  # after 4 sublayers (S = 3): b_0, block 1 and the partial block 2
    assert all(r > 0 for r in result["ratios"].values())

    assert {"step_time_block_over_baseline_old", "step_time_block_new_over_old"} <= set(
        result["ratios"]
    )
    assert {"stage0_peak_memory_block_new_over_old", "stage1_peak_memory_block_new_over_old"} <= (
        set(result["ratios"])
    )
    for variant in result["variants"].values():
        assert all(m["peak_bytes"] > 0 for m in variant["memory"])
    # one repetition: a ratio, but no interval around it; the slowest stage's compute instead
    assert result["step_time_block_over_baseline_interval"] is None
    stages = result["variants"]["baseline"]["stages"]
    slowest = max(stages, key=lambda r: r["forward_ms"] + r["backward_ms"])["stage"]
    assert result["bottleneck_stage"] == slowest
    # the old path runs no C kernel; the new one at least its norms (each stage has layers)
    for name, variant in result["variants"].items():
        kernel_ms = [r["kernel_ms"] for r in variant["stages"]]
        old = variant["path"] == "old"
        assert all(ms == 0 for ms in kernel_ms) if old or requirement() else all(kernel_ms), name
    for extra in result["block_extra_ms"]:
        stage = extra["stage"]
        ms = {
            n: next(r for r in result["variants"][n]["stages"] if r["stage"] == stage)
            for n in ("block_packed", "baseline")
        }
        assert extra["kernels"] == pytest.approx(
            ms["block_packed"]["kernel_ms"] - ms["baseline"]["kernel_ms"]
        )

    depth = depth_attention_bench.run(tmp_path, n=3, tokens=64, dim=16, reps=1, warmup=0)
    model = model_smoke(tmp_path)
    summary = summary_markdown(depth, result, model=model)
    assert "packed / tuple payload" in summary and "Block AttnRes / baseline" in summary
    assert "All equal the prediction." in summary
    assert "too few repetitions for an interval" in summary
    assert f"stage {slowest} compute per micro-batch, Block AttnRes / baseline" in summary
    assert "stage 1 extra compute per micro-batch in the C kernels" in summary
    assert "vs a plain-PyTorch GPT" in summary and "Peak memory per pipeline stage" in summary
    # one repetition gives the model ratios no interval; enough give each shape's new path one
    assert "intervals, new path" not in summary
    within = model["step"]["2x32 S=3"]["ratio_intervals"]
    within["block_over_baseline_new"], within["full_over_baseline_new"] = (
        (1.01, 1.09, 0.965),
        (1.1, 1.2, 0.965),
    )
    summary = summary_markdown(depth, result, model=model)
    expected = "Their 96% intervals, new path: 2x32 S=3: Block [1.010, 1.090], Full [1.100, 1.200]."
    assert expected in summary


def test_norm_bench_smoke(tmp_path):
    from attnres_dist.ops.cpu_rms_norm import requirement
    from bench import norm_bench

    result = norm_bench.run(tmp_path, tokens=32, reps=1, warmup=0)
    assert (tmp_path / "norm.json").exists()
    rows = norm_bench.markdown_rows(result)
    if requirement() is not None:
        assert result["skipped"] == requirement() and "skipped" in rows[0]
        return
    assert set(result["dims"]) == {str(d) for d in norm_bench.DIMS} and len(rows) == 4
    for v in result["dims"].values():
        assert v["cpu_over_torch"] > 0 and v["merge_norm"]["fused_over_composed"] > 0
        # both within float32 rounding of the definition
        assert max(v["max_error_vs_float64"].values()) < 1e-4
    assert rows[0].startswith("| RMSNorm time, C kernel / torch (D = 64) |")
    assert rows[1].startswith("| Block phase-2 merge + RMSNorm time, fused / composed (D = 64) |")


SMOKE_SHAPE = ("model.num_layers=2", "model.hidden_size=32", "model.attnres.block_size=3")


def model_smoke(tmp_path) -> dict:
    shapes = {"2x32 S=3": SMOKE_SHAPE}
    return model_bench.run(
        tmp_path, shapes, SMOKE_SHAPE, batch=2, seq=16, reps=1, warmup=0, fixed_reps=2
    )


def test_model_bench_smoke(tmp_path):
    result = model_smoke(tmp_path)
    assert (tmp_path / "model.json").exists()
    ratios = result["step"]["2x32 S=3"]["ratios"]
    expected = {f"{m}_over_baseline_{p}" for m in ("block", "full") for p in ("old", "new")}
    expected |= {f"{m}_new_over_old" for m in ("baseline", "block", "full")}
    expected |= {f"{m}_over_baseline_new" for m in ("delta_block", "delta_full")}
    assert set(ratios) == expected and all(r > 0 for r in ratios.values())
    intervals = result["step"]["2x32 S=3"]["ratio_intervals"]
    assert set(intervals) == expected and all(v is None for v in intervals.values())
    variants = result["step"]["2x32 S=3"]["variants"]
    assert "megatron attention" in variants["block_old"]["model"]
    assert "sdpa attention" in variants["block_new"]["model"]
    assert "impl=lean" in variants["block_old"]["model"]
    fixed = result["fixed_cost"]["2x32 S=3"]
    assert fixed["tokens"] == model_bench.FIXED_TOKENS and set(fixed["step_ms"]) == set(
        model_bench.MODES
    )
    (baseline,) = variants["baseline_new"]["step_s"]["samples"]  # one repetition
    for mode in ("block", "full"):  # the full-size difference is the step group's
        (step,) = variants[f"{mode}_new"]["step_s"]["samples"]
        assert fixed[mode]["extra_ms_full_size"] == pytest.approx((step - baseline) * 1e3)
    assert all(ms > 0 for ms in fixed["step_ms"].values())
    rows = "\n".join(fixed_cost_rows(result))
    assert "| 2x32 S=3 |" in rows and "8-token sequence" in rows
    kernels = {n: v["kernel_s"] for n, v in variants.items()}
    if requirement() is None:  # the old path runs no C kernel; the new one its norms, and
        # AttnRes its depth mixing besides
        assert all(kernels[f"{m}_old"]["by_kernel"] == {} for m in model_bench.MODES)
        assert set(kernels["baseline_new"]["by_kernel"]) == {"rms_norm_fwd", "rms_norm_bwd"}
        assert {"phase1_fwd", "phase1_bwd"} <= set(kernels["block_new"]["by_kernel"])
        for mode in ("block", "full"):  # one repetition: the differences of its two steps
            share = result["step"]["2x32 S=3"]["kernel_share"][mode]
            extra = kernels[f"{mode}_new"]["median"] - kernels["baseline_new"]["median"]
            assert share["kernel_extra_ms"] == pytest.approx(extra * 1e3)
        rows = "\n".join(kernel_rows(result))
        assert "| 2x32 S=3 | block |" in rows and "phase1_bwd" in rows
    throughput = result["throughput"]["ratios"]
    assert set(throughput) == {
        "attnres_new_over_plain",
        "attnres_old_over_plain",
        "baseline_new_over_plain",
    }
    assert all(r > 0 for r in throughput.values())


def test_peak_bytes_counts_live_tensors_at_their_peak():
    import torch

    x = torch.randn(500, 500)  # 1 MB, live before: not counted

    def two_live_then_freed():
        a = x * 2  # +1 MB
        b = a.exp()  # +1 MB: the peak, 2 MB live
        del a
        return float(b.sum())

    peak, method = peak_bytes(two_live_then_freed)
    assert 2 * x.nbytes <= peak <= 2 * x.nbytes + 4096, peak
    assert "profiler" in method


def test_generation_bench_smoke(tmp_path):
    """Quick mode: every path decodes the same greedy tokens; the summary shows the ratio."""
    result = generation_bench.run(
        tmp_path, prompt=8, new=4, reps=1, warmup=0, overrides=TINY_MODEL[:3]
    )
    assert (tmp_path / "generation.json").exists()
    assert result["greedy_tokens_equal"]
    assert all(v > 0 for v in result["tokens_per_s"].values())
    rows = "\n".join(generation_rows(result))
    assert "KV cache / recompute" in rows and "same greedy tokens" in rows


@pytest.mark.slow
def test_precision_bench_smoke(small_dataset, tmp_path):
    """fp32 vs bf16 engine vs ZeRO-1 at dp = 2: it runs and the state bytes add up."""
    result = precision_bench.run(
        tmp_path, overrides=(f"data.path={small_dataset}", *TINY_MODEL), reps=1, warmup=1
    )
    assert (tmp_path / "precision.json").exists()
    v = result["variants"]
    n, tensors = v["fp32"]["parameters_per_rank"], v["fp32"]["parameter_tensors_per_rank"]
    # fp32 ZeRO-0 holds 16 bytes per parameter (weight, gradient, two AdamW moments) and
    # AdamW's fp32 step count per tensor
    assert v["fp32"]["state_bytes_per_rank"] == [16 * n + 4 * tensors] * 2
    # ZeRO-1 shards the fp32 master copy and the moments (12 bytes) over the two ranks
    for name in ("bf16", "zero1"):
        assert all(b < 16 * n for b in v[name]["state_bytes_per_rank"]), name
    assert all(x["step_s"]["median"] > 0 for x in v.values())
    text = "\n".join(precision_markdown(result))
    assert "Precision and ZeRO-1" in text and "| zero1 |" in text


def test_compile_bench_smoke(tmp_path):
    """Every layer and the final aggregation one graph each, no break, one compile each and
    no recompile; the counts and the summary rows exist for each mode (aot_eager: no code
    generation)."""
    from bench import compile_bench

    shape = ("model.num_layers=2", "model.hidden_size=32")
    result = compile_bench.run(tmp_path, backend="aot_eager", shape=shape, batch=2, seq=16, steps=2)
    assert (tmp_path / "compile.json").exists()
    assert set(result["modes"]) == {"baseline", "block", "full"}
    for m in result["modes"].values():
        assert (m["graphs"], m["graph_breaks"]) == (3, 0)  # 2 layers, the final aggregation
        assert (m["compiled_graphs"], m["recompiles"]) == (3, 0)
        assert m["aten_ops"]["eager"] > 0 and m["aten_ops"]["compiled"] > 0
    rows = compile_bench.markdown_rows(result)
    assert len(rows) == 3 and rows[1].startswith("| compiled step time / eager, block |")


def test_host_bench_smoke(tmp_path):
    """Every variant (ours on DeepSpeed's bf16 engine, eager, per layer and per chunk; the
    plain GPT eager, per block and whole) steps, its aten ops are counted, and the ratios and
    the summary's floors are there (aot_eager: no code generation; 2 layers)."""
    from bench import host_bench

    shape = (
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.num_attention_heads=4",
        "model.seq_length=8",
        "model.attnres.block_size=1",
    )
    result = host_bench.run(
        tmp_path, backend="aot_eager", reps=2, steps=1, warmup=1, shape=shape, floor_reps=6
    )
    assert (tmp_path / "host.json").exists()
    modes = ("baseline", "block", "full")
    names = {f"{m}_{t}" for m in modes for t in ("eager", "compiled", "chunk")}
    names |= {"plain_eager", "plain_compiled", "plain_whole"}
    assert set(result["variants"]) == names | {"baseline_every_guard", "block_every_guard"}
    for v in result["variants"].values():
        assert v["host_ms"] > 0 and v["wall_ms"] > 0 and v["aten_ops"] > 0
    assert len(result["ratios"]) == 10
    assert all(r["host"]["ratio"] > 0 and r["ops"] > 0 for r in result["ratios"].values())
    text = "\n".join(host_bench.markdown(result))
    assert "| Block / baseline, host time |" in text and "<= 1.1 |" in text
    assert "| baseline per chunk / plain GPT whole, host time |" in text
    floors = {(f["label"], f["kind"]): f for f in result["floors"]}
    assert set(floors) == {
        ("Block / baseline", "host"),
        ("Block / baseline", "ops"),
        ("baseline / plain GPT whole", "host"),
        ("baseline / plain GPT per block", "host"),
    }
    for f in floors.values():  # six paired repetitions: an interval exists
        assert f["ratio"] > 0 and f["within"] == (f["ratio"] <= f["floor"])
        assert f["kind"] == "ops" or f["interval"][0] <= f["ratio"] <= f["interval"][1]
    assert len(result["floor_samples"]["block_chunk"]["host_ms"]) == 6
    assert "measured on their own" in text and "| Block / baseline, host time | " in text
    assert set(result["steady_over_every_guard"]) == {"baseline", "block"}
    assert "steady guards" in text
    eager = {n: v["host_reads"] for n, v in result["variants"].items() if "host_reads" in v}
    assert eager == {f"{m}_eager": 0 for m in (*modes, "plain")}  # ours: the device's skip
    assert "tensor value per eager step (on a GPU, waits): none in any variant." in text


@pytest.mark.slow
def test_moe_bench_smoke(small_dataset, tmp_path):
    """MoE Block and MoE baseline at dp = ep = 2: both step, the dispatcher's collectives
    are seen and take part of the step, the summary rows exist."""
    from bench import moe_bench

    small = (f"data.path={small_dataset}", "model.num_layers=2", "model.hidden_size=32")
    result = moe_bench.run(tmp_path, overrides=small, reps=1, warmup=1)
    assert (tmp_path / "moe.json").exists()
    for v in result["variants"].values():
        assert v["step_s"]["median"] > 0 and v["dispatch_s_median"] > 0
        assert 0 < v["dispatch_share"] < 1
    text = "\n".join(moe_bench.markdown(result))
    assert "MoE Block / MoE baseline" in text and "| moe_block |" in text
