"""``check-config`` on virtual schedules: chunks per rank, each transition naive vs cached.

The expected text is worked out by hand for the default model shape (configs/tiny.yaml: 4
layers, block size 2 = one block per layer) with micro-batches of 8, [s, b, h] = [128, 8, 128]
fp32 = 524,288 bytes per block tensor, over P = 2 ranks x V = 2 chunks, chunk c = layer c on
rank c mod 2:

* chunk 0 -> 1: b0, b1 (rank 1 holds nothing yet): 2 tensors, both ways;
* chunk 1 -> 2: naive b0..b2; rank 0 kept b0, b1 from chunk 0, so cached b2 alone;
* chunk 2 -> 3: naive b0..b3; rank 1 kept b0..b2 from chunk 1, so cached b3 alone.

Naive 9 tensors (4,718,592 bytes), cached 4 (2,097,152). Completed blocks b0 aside: naive
1 + 2 + 3 = 6 = C(C-1)/2 N_p with C = 4, N_p = 1; cached 1 + 1 + 1 = 3 = P(P-1)/2 + (V-1)
P(P-1); the paper's count (a rank keeps only what it received) 1 + 2 + 2 = 5 = P(P-1)/2 +
(V-1) P^2.
"""

from __future__ import annotations

from attnres_dist.cli import main
from tests.conftest import REPO

TINY = str(REPO / "configs" / "tiny.yaml")
INTERLEAVED = ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]
BATCH = ["train.micro_batch_size=8", "train.global_batch_size=32"]  # b = 8 in the shapes below


def check_config(capsys, *overrides) -> list[str]:
    assert main(["check-config", "--config", TINY, *BATCH, *overrides]) == 0
    return capsys.readouterr().out.splitlines()


def test_interleaved_p2_v2_by_hand(capsys):
    lines = check_config(capsys, *INTERLEAVED)
    assert "  rank 0: chunk 0 (embedding, layer 0); chunk 2 (layer 2)" in lines
    assert "  rank 1: chunk 1 (layer 1); chunk 3 (layer 3, final aggregation, head + loss)" in lines
    assert (
        "  parallel.cross_stage_cache: true: the cached payload is sent (columns marked *)" in lines
    )
    rows = [ln for ln in lines if ln.startswith("| chunk ")]
    assert rows == [
        "| chunk 0 -> 1 (rank 0 -> 1) | 1 | b0..b1 | [2, 128, 8, 128] | 1,048,576 | b0..b1 | "
        "[2, 128, 8, 128] | 1,048,576 |",
        "| chunk 1 -> 2 (rank 1 -> 0) | 2 | b0..b2 | [3, 128, 8, 128] | 1,572,864 | b2 | "
        "[1, 128, 8, 128] | 524,288 |",
        "| chunk 2 -> 3 (rank 0 -> 1) | 3 | b0..b3 | [4, 128, 8, 128] | 2,097,152 | b3 | "
        "[1, 128, 8, 128] | 524,288 |",
    ]
    assert any(ln.endswith("cached bytes * |") for ln in lines)
    assert (
        "per micro-batch, each way: naive 4,718,592 bytes, cached 2,097,152 bytes (44%); "
        "widest payload 4 -> 2 tensors"
    ) in lines
    assert "  naive:  6; formula C(C-1)/2 N_p = 6" in lines
    assert lines[-2].startswith("  cached: 3; formula P(P-1)/2 N_p + (V-1) P(P-1) N_p = 3 ")
    assert lines[-1].startswith("          the paper's P(P-1)/2 N_p + (V-1) P^2 N_p = 5 ")
    assert "formulas exact here" in lines[-4]


def test_the_naive_choice_is_marked_and_1f1b_keeps_its_table(capsys):
    lines = check_config(capsys, *INTERLEAVED, "parallel.cross_stage_cache=false")
    assert "  parallel.cross_stage_cache: false: the naive payload is sent (columns marked *)" in (
        lines
    )
    assert any("| naive bytes * |" in ln for ln in lines)
    plain = check_config(capsys)
    assert not any("chunk" in ln for ln in plain)
    assert any(ln.startswith("| stage 0 -> 1 (after 2 layers) |") for ln in plain)


def test_dualpipev_turn_stays_on_the_rank(capsys):
    # rank 0: chunks 0 and 3 (head); rank 1: chunks 1 and 2, handing 1 -> 2 over locally
    lines = check_config(capsys, "parallel.schedule=dualpipev")
    assert "  rank 1: chunk 1 (layer 1); chunk 2 (layer 2)" in lines
    assert "  tied embedding: one shared copy on rank 0" in lines
    assert "| chunk 1 -> 2 (rank 1 -> 1) | 2 | stays on the rank | - | 0 | - | - | 0 |" in lines
    # chunk 2 -> 3 back to rank 0, which kept b0, b1 from chunk 0: cached b2, b3
    assert (
        "| chunk 2 -> 3 (rank 1 -> 0) | 3 | b0..b3 | [4, 128, 8, 128] | 2,097,152 | b2..b3 | "
        "[2, 128, 8, 128] | 1,048,576 |"
    ) in lines
