"""Smoke run of ``make bench``'s pipeline part: it runs, the wire bytes equal the contract.

One 2-rank job with a tiny model and one repetition: a check that the benchmark works and
that packed and tuple payloads put exactly the predicted bytes on the wire, not a measurement.
"""

from __future__ import annotations

import pytest

from attnres_dist.bench import depth_attention_bench, generation_bench, pipeline_bench
from attnres_dist.bench.run import generation_rows, summary_markdown
from tests.conftest import TINY_MODEL


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

    depth = depth_attention_bench.run(tmp_path, n=3, tokens=64, dim=16, reps=1, warmup=0)
    summary = summary_markdown(depth, result)
    assert "packed / tuple payload" in summary and "Block AttnRes / baseline" in summary
    assert "All equal the prediction." in summary


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
