"""MoE models in every parallel layout equal one process (fp32, losses and every parameter).

The equivalence case (``equivalence_helpers.overrides``: 3 optimizer steps with clipping)
with MoE layers (4 experts, top-2, a shared expert, the first layer dense, load-balancing
and z-losses on) trained under torchrun: expert parallelism alone (dp = ep = 2), beside
pipeline stages (pp = 2 x dp = 2 x ep = 2) and with experts replicated (dp = 4, ep = 2); the
DualPipeV and interleaved schedules with ep = 2; both recompute modes; both token dispatchers.
Each must match the single-process run of its residual mode within TOL; so must ZeRO-1 with
ep = 2, and DeepSpeed's bf16 engine with ep = 2 tracks it (the experts as MoE param groups).
A checkpoint written at ep = 2 under ZeRO-1 resumes at ep = 1 on two stages (experts stored by
global index) and ends where the uninterrupted reference does, and at its own layout bit for
bit. The selected cases of one world size share one launch.
"""

from __future__ import annotations

import pytest
import torch

from tests.equivalence_helpers import (
    MOE_BATCH,
    MOE_LAYERS,
    assert_matches,
    assert_tracks_fp32,
    overrides,
    result_of,
    selected_params,
    train_by_world,
)

MOE = MOE_LAYERS | MOE_BATCH
EP2 = {"parallel.dp": 2, "parallel.ep": 2}
CASES = {
    "ep2-block-attnres": (2, "block", EP2 | {"parallel.recompute": "attnres"}),
    "pp2-full": (2, "full", {"parallel.pp": 2}),
    "pp2-ep2-block-full-recompute": (
        4,
        "block",
        EP2 | {"parallel.pp": 2, "parallel.recompute": "full"},
    ),
    "dualpipev-ep2-full": (4, "full", EP2 | {"parallel.pp": 2, "parallel.schedule": "dualpipev"}),
    "interleaved-ep2-baseline-allgather": (
        4,
        "baseline",
        EP2
        | {
            "parallel.pp": 2,
            "parallel.schedule": "interleaved",
            "parallel.virtual_stages": 2,
            "model.moe.token_dispatcher": "allgather",
        },
    ),
    "dp4-ep2-block": (4, "block", {"parallel.dp": 4, "parallel.ep": 2}),
}
# DeepSpeed's optimizer wrappers with split experts: fp32 ZeRO-1 must match; bf16 tracks fp32
WRAPPED = {
    "zero1-ep2-block": (2, "block", EP2 | {"parallel.zero_stage": 1}, assert_matches),
    "bf16-zero1-dualpipev-ep2-full": (
        4,
        "full",
        EP2 | {"parallel.pp": 2, "parallel.schedule": "dualpipev", "runtime.dtype": "bf16"},
        lambda result, reference, label: assert_tracks_fp32(result, reference),
    ),
}
# written at dp = ep = 2 under ZeRO-1 (step 2 of 3: experts' master weights and AdamW state
# read from their partitions), resumed at pp = 2, ep = 1, ZeRO-0, and as it was written
SAVE = (
    2,
    "block",
    EP2 | {"parallel.zero_stage": 1, "checkpoint.every": 2, "checkpoint.keep_last": 3},
)
RESUME = (2, "block", {"parallel.pp": 2})


def args(data: str, tmp, name: str, mode: str, extra: dict) -> list[str]:
    return overrides(data, mode, str(tmp / "runs" / name), **MOE, **extra)


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("moe")
    by_world: dict[int, dict] = {}
    modes = set()
    selected = [
        (p["case"], CASES[p["case"]])
        for p in selected_params(request, "test_layout_matches_single_process")
    ] + [
        (p["case"], WRAPPED[p["case"]][:3])
        for p in selected_params(request, "test_optimizer_wrappers_with_split_experts")
    ]
    for name, (world, mode, extra) in selected:
        by_world.setdefault(world, {})[name] = args(small_dataset, tmp, name, mode, extra)
        modes.add(mode)
    saved = tmp / "runs" / "save" / "checkpoints" / "step-00000002"
    resumes = {
        "resume": "test_checkpoint_reshards_across_expert_layouts",
        "resume-same": "test_resume_at_the_same_layout_is_bitwise",
    }
    for name, test in resumes.items():
        if selected_params(request, test):
            cases = by_world.setdefault(2, {})
            cases.setdefault("save", args(small_dataset, tmp, "save", "block", SAVE[2]))
            layout = RESUME[2] if name == "resume" else SAVE[2]
            resume = layout | {"checkpoint.resume": str(saved)}
            cases[name] = args(small_dataset, tmp, name, "block", resume)
            modes.add("block")
    refs = {mode: args(small_dataset, tmp, f"ref-{mode}", mode, {}) for mode in sorted(modes)}
    return train_by_world(tmp, refs, by_world)


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(case, runs):
    mode = CASES[case][1]
    assert_matches(result_of(runs, case), result_of(runs["reference"], mode), f"moe {case}")


def test_checkpoint_reshards_across_expert_layouts(runs):
    reference = result_of(runs["reference"], "block")
    assert_matches(result_of(runs, "save"), reference, "moe save ep2")
    resumed = result_of(runs, "resume")
    assert len(resumed["losses"]) == 1  # step 3 only: it resumed from step 2
    last_step = {**reference, "losses": reference["losses"][2:]}
    assert_matches(resumed, last_step, "moe resume ep2 -> pp2")


def test_resume_at_the_same_layout_is_bitwise(runs):
    """Resumed at dp = ep = 2 from step 2: step 3 and every parameter equal the uninterrupted
    run's bit for bit (experts, router and optimizer state read back by global index)."""
    whole, resumed = result_of(runs, "save"), result_of(runs, "resume-same")
    assert resumed["losses"] == whole["losses"][2:]
    assert resumed["params"].keys() == whole["params"].keys()
    for name, value in whole["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@pytest.mark.parametrize("case", list(WRAPPED))
def test_optimizer_wrappers_with_split_experts(case, runs):
    """ZeRO-1 and DeepSpeed's bf16 engine take the experts as MoE param groups over their
    expert data-parallel group (``pipeline/expert_groups.py``)."""
    _, mode, _, check = WRAPPED[case]
    check(result_of(runs, case), result_of(runs["reference"], mode), f"moe {case}")
