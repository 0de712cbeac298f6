"""Sequence parallelism (tp = 2) equals one process, dense and MoE; its boundaries carry 1 / tp.

Megatron's sequence parallelism splits the activations outside the tensor-parallel matmuls
along the sequence, and the depth state with them: each tensor rank stores and sends its
split of every completed block and of the partial block. The equivalence case
(``equivalence_helpers.overrides``, 8 micro-batches of 2) at tp = 2 with sequence parallelism,
beside pipeline stages, DualPipeV and interleaved, for dense and MoE models (experts split
over tensor ranks, and over data-parallel ranks with ep = 2), must match the single-process
run of its mode within TOL. The profiler measures, on the wire, the bytes one rank sends over
a stage boundary: the contract's per-rank payload, 1 / tp of the payload without it.
"""

from __future__ import annotations

import json

import pytest

from attnres_dist.config import load_config
from attnres_dist.pipeline.contract import boundary_specs_for_config
from tests.conftest import TINY_MODEL, run_job
from tests.equivalence_helpers import (
    MOE_BATCH,
    MOE_LAYERS,
    assert_matches,
    overrides,
    result_of,
    selected_params,
    train_by_world,
)

SP = {"parallel.tp": 2, "parallel.sequence_parallel": True}
ALLGATHER = {"model.moe.token_dispatcher": "allgather"}  # gloo: tp and ep together (rules)
CASES = {  # name: (world, mode, moe, settings)
    "tp2-block": (2, "block", False, {}),
    "tp2-moe-block": (2, "block", True, {}),
    "pp2-tp2-full": (4, "full", False, {"parallel.pp": 2}),
    "dp2-ep2-tp2-moe-block": (4, "block", True, {"parallel.dp": 2, "parallel.ep": 2} | ALLGATHER),
    "interleaved-tp2-baseline-full-recompute": (
        4,
        "baseline",
        False,
        {
            "parallel.pp": 2,
            "parallel.schedule": "interleaved",
            "parallel.virtual_stages": 2,
            "parallel.recompute": "full",
        },
    ),
    "dualpipev-tp2-moe-full": (
        4,
        "full",
        True,
        {"parallel.pp": 2, "parallel.schedule": "dualpipev", "parallel.recompute": "attnres"},
    ),
}


def reference_name(mode: str, moe: bool) -> str:
    return f"{mode}-moe" if moe else mode


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("sp")
    by_world: dict[int, dict] = {}
    refs = {}
    for params in selected_params(request, "test_sequence_parallel_matches_single_process"):
        name = params["case"]
        world, mode, moe, extra = CASES[name]
        base = MOE_BATCH | (MOE_LAYERS if moe else {})
        run = str(tmp / "runs" / name)
        by_world.setdefault(world, {})[name] = overrides(
            small_dataset, mode, run, **base, **SP, **extra
        )
        ref = reference_name(mode, moe)
        refs[ref] = overrides(small_dataset, mode, str(tmp / "runs" / f"ref-{ref}"), **base)
    if selected_params(request, "test_moe_checkpoint_reshards_from_tensor_to_expert_parallel"):
        saved = tmp / "runs" / "tp2-save" / "checkpoints" / "step-00000002"
        save = SP | {"checkpoint.every": 2}
        resume = {"parallel.dp": 2, "parallel.ep": 2, "checkpoint.resume": str(saved)}
        cases = by_world.setdefault(2, {})
        for name, extra in (("tp2-save", save), ("ep2-resume", resume)):
            run = str(tmp / "runs" / name)
            cases[name] = overrides(small_dataset, "block", run, **MOE_BATCH, **MOE_LAYERS, **extra)
        refs["block-moe"] = overrides(
            small_dataset, "block", str(tmp / "runs" / "ref-block-moe"), **MOE_BATCH, **MOE_LAYERS
        )
    return train_by_world(tmp, refs, by_world)


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_matches_single_process(case, runs):
    _, mode, moe, _ = CASES[case]
    reference = result_of(runs["reference"], reference_name(mode, moe))
    assert_matches(result_of(runs, case), reference, f"sp {case}")


def test_profiled_boundary_bytes_per_rank_fall_by_tp(small_dataset, tmp_path):
    """pp = 2 x tp = 2, Block: each tensor rank sends its split of the blocks, one tensor of
    the contract's per-rank bytes, half the payload without sequence parallelism."""
    args = [
        f"data.path={small_dataset}",
        *TINY_MODEL,
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        f"output.run_dir={tmp_path}",
    ]
    cli = ["-m", "attnres_dist.cli", "profile", "--warmup", "1", "--steps", "2"]
    run_job([*cli, "--trace-steps", "1", "--pingpong-reps", "3", "--modes", "block", *args], 4)
    profile = json.loads((tmp_path / "block" / "comm_profile.json").read_text())
    [row] = profile["boundaries"]
    cfg = load_config(None, [*args, "model.attnres.mode=block"])
    [split] = boundary_specs_for_config(cfg, vocab_size=256)
    cfg.parallel.sequence_parallel = False
    [whole] = boundary_specs_for_config(cfg, vocab_size=256)
    assert split.bytes_forward * 2 == whole.bytes_forward
    assert split.shape[1] * 2 == whole.shape[1]  # [k, s / tp, b, h]
    for direction in ("forward", "backward"):
        measured = row[direction]
        assert measured["measured_bytes_per_micro_batch"] == split.bytes_forward
        assert measured["tensors_per_micro_batch"] == 1
    assert profile["bytes_equal_contract"]


def test_moe_checkpoint_reshards_from_tensor_to_expert_parallel(runs):
    """Written at tp = 2 with sequence parallelism (experts split over the tensor ranks) at
    step 2, resumed at dp = ep = 2 (whole experts split over data-parallel ranks): step 3
    ends where the uninterrupted single-process run does."""
    reference = result_of(runs["reference"], "block-moe")
    assert_matches(result_of(runs, "tp2-save"), reference, "sp tp2 moe save")
    resumed = result_of(runs, "ep2-resume")
    assert len(resumed["losses"]) == 1
    assert_matches(resumed, {**reference, "losses": reference["losses"][2:]}, "tp2 -> ep2")
