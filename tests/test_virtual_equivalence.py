"""Virtual pipeline stages reproduce the single-process reference (fp32, real processes, gloo).

``dualpipev`` (the V shape, DeepSpeed's DualPipeV schedule) and ``interleaved`` (the looped
layout, Megatron-Core's interleaved order) train 3 optimizer steps under torchrun on the data of
the single-process reference, with gradient clipping active; per-step losses, the final
validation loss (the forward-only schedules) and every parameter must match within TOL. With
block size 3 and one or two layers (2 or 4 sublayers) per chunk, block boundaries fall inside
chunks, so partial blocks cross the transitions. The grid and its machinery are those of
``test_pipeline_equivalence.py`` (``equivalence_helpers.py``). The cross-stage cache is on (the
default) except where a case turns it off; the two-rank grid also records the wire and checks
that every payload is the cache plan's (``p2p_record.py``): cached payloads are smaller, the
bytes exactly predicted.
"""

from __future__ import annotations

import pytest

from tests.equivalence_helpers import (
    MODES,
    TOL,
    assert_matches,
    overrides,
    reference_runs,
    result_of,
    selected_params,
    single_process_reference,
    train_case,
)
from tests.p2p_record import check_wire, plan_bytes, recorded_cases

SCHEDULES = {
    "dualpipev": {"parallel.schedule": "dualpipev"},
    "interleaved": {"parallel.schedule": "interleaved", "parallel.virtual_stages": 2},
}


@pytest.fixture(scope="module")
def references(small_dataset, tmp_path_factory):
    return reference_runs(small_dataset, tmp_path_factory.mktemp("reference"))


def check(result: dict, reference: dict, label: str) -> None:
    assert_matches(result, reference, label)
    assert abs(result["valid"] - reference["valid"]) <= TOL * (1 + abs(reference["valid"]))


# the cross-stage cache is on by default; off (the naive payload) in block mode for comparison
TWO_RANKS = [(s, m, True) for s in SCHEDULES for m in MODES] + [
    (s, "block", False) for s in SCHEDULES
]


def two_rank_args(data: str, run_dir, schedule: str, mode: str, cache: bool) -> list[str]:
    extra = {**SCHEDULES[schedule], "parallel.cross_stage_cache": str(cache).lower()}
    return overrides(data, mode, str(run_dir), pp=2, **extra)


def two_rank_name(schedule: str, mode: str, cache: bool) -> str:
    return f"{schedule}-{mode}-{'cache' if cache else 'naive'}"


@pytest.fixture(scope="module")
def two_ranks(small_dataset, tmp_path_factory, request):
    """The selected two-rank cases, recorded on the wire, in one launch."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    cases = {}
    for params in selected_params(request, "test_two_ranks_match_reference"):
        key = (params["schedule"], params["mode"], params["cache"])
        cases[two_rank_name(*key)] = two_rank_args(small_dataset, tmp / two_rank_name(*key), *key)
    return cases, recorded_cases(tmp, cases, nproc=2)


@pytest.mark.parametrize(
    "schedule, mode, cache", TWO_RANKS, ids=lambda v: {True: "cache", False: "naive"}.get(v, v)
)
def test_two_ranks_match_reference(schedule, mode, cache, references, two_ranks):
    """Also on the wire: every payload sent is the cache plan's (``p2p_record.check_wire``)."""
    cases, recorded = two_ranks
    name = two_rank_name(schedule, mode, cache)
    result, records = result_of(recorded, name)
    check(result, references[mode], f"{schedule} {mode} pp=2 cache={cache}")
    sent = check_wire(cases[name], records)
    cached, naive = plan_bytes(cases[name])
    if mode != "baseline":  # baseline carries one hidden state either way
        assert cached < naive, (cached, naive)
    print(
        f"{schedule} {mode} cache={cache}: {sent:,} bytes sent (plan per micro-batch: "
        f"cached {cached:,}, naive {naive:,})"
    )


def test_interleaved_beside_data_parallel(references, small_dataset, tmp_path):
    """dp = 2 beside pp = 2: 2 micro-batches per data-parallel rank, Megatron's minimum."""
    args = overrides(
        small_dataset, "block", str(tmp_path / "run"), pp=2, dp=2, **SCHEDULES["interleaved"]
    )
    check(train_case(tmp_path, "case", args, nproc=4), references["block"], "interleaved dp=2")


def test_three_chunks_per_rank_with_dropout_and_recompute(small_dataset, tmp_path):
    """V = 3 over 6 layers (one-layer chunks), dropout on (masks keyed by the micro-batch, not
    by the order the chunks run in) and every layer recomputed in its backward."""
    extra = {"model.num_layers": 6, "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
    reference = single_process_reference(small_dataset, tmp_path, **extra)
    args = overrides(
        small_dataset,
        "block",
        str(tmp_path / "run"),
        pp=2,
        **extra,
        **{
            "parallel.schedule": "interleaved",
            "parallel.virtual_stages": 3,
            "parallel.recompute": "full",
        },
    )
    check(train_case(tmp_path, "case", args, nproc=2), reference, "interleaved V=3 dropout")


# pp = 4: 8 one-layer chunks, 8 micro-batches (DualPipeV's 2P); 8 evaluation micro-batches, so
# evaluation on the V runs DualPipeV's own forward-only schedule
EIGHT = {"model.num_layers": 8, "train.global_batch_size": 16, "train.eval_batches": 8}


@pytest.fixture(scope="module")
def reference_8_layers(small_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref8")
    return train_case(tmp, "ref", overrides(small_dataset, "block", str(tmp / "r"), **EIGHT), 1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_four_ranks_match_reference(schedule, reference_8_layers, small_dataset, tmp_path):
    extra = {**EIGHT, **SCHEDULES[schedule]}
    args = overrides(small_dataset, "block", str(tmp_path / "run"), pp=4, **extra)
    result = train_case(tmp_path, "case", args, nproc=4)
    check(result, reference_8_layers, f"{schedule} block pp=4")


def test_named_micro_batches_get_the_keys_of_counted_ones():
    """Chunks run out of order: naming micro-batch i gives the key that counting in order gives
    the i-th forward (data-parallel offset included)."""
    from attnres_dist.model import dropout_streams as ds

    ds.begin_step(7, 3, first_micro_batch=4)
    counted = []
    for _ in range(3):
        ds.next_micro_batch()
        counted.append(ds.current_key())
    ds.begin_step(7, 3, first_micro_batch=4)
    named = {}
    for mb in (2, 0, 1, 0):
        ds.use_micro_batch(mb)
        named[mb] = ds.current_key()
    ds.end()
    assert [named[i] for i in range(3)] == counted
    assert counted[0] == (7, 3, 4)


@pytest.mark.slow
def test_interleaved_beside_tensor_parallel(references, small_dataset, tmp_path):
    """tp = 2 inside each of pp = 2 ranks: every tensor rank sends the whole payload."""
    extra = {**SCHEDULES["interleaved"], "parallel.tp": 2}
    args = overrides(small_dataset, "block", str(tmp_path / "run"), pp=2, **extra)
    check(train_case(tmp_path, "case", args, nproc=4), references["block"], "interleaved tp=2")
