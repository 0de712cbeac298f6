"""The equivalence grid of the fast tier: every pair of factors in a covering array.

Six factors (layout, schedule, residual mode, recompute, dtype, compile) make 540 combinations
of real pipeline jobs; ``covering.covering_cases`` picks a few that hold every pair of levels
of two factors, and a test checks that they do. Each case trains the equivalence case
(``equivalence_helpers.overrides``: 3 optimizer steps with clipping) under torchrun; the cases
of one world size share one launch (``workers/train_cases.py``), so start-up is paid once per
world size, and each case is still its own test. The references are the single-process eager
runs (one launch): fp32 cases must match theirs within TOL; bf16 cases track the fp32 run
within the bf16 tolerances (``equivalence_helpers.assert_tracks_fp32``). Compiled cases (every
layer compiled, aot_eager: Dynamo's trace and AOT autograd; inductor's code is checked by
``test_compile.py``) run the traceable ops (``TRACED``), and so does their reference. The
full products of each factor pair, and the grids along one factor, are in
``test_pipeline_equivalence.py``, ``test_virtual_equivalence.py``, ``test_compile.py`` and
``test_precision.py``.
"""

from __future__ import annotations

import math

import pytest

from tests.covering import covered_pairs, covering_cases, pairs
from tests.equivalence_helpers import (
    assert_matches,
    assert_tracks_fp32,
    overrides,
    result_of,
    train_cases,
)

FACTORS = {
    "layout": ["pp2", "pp2-dp2", "pp2-tp2"],
    "schedule": ["1f1b", "dualpipev", "interleaved"],
    "mode": ["baseline", "block", "full", "delta_block", "delta_full"],
    "recompute": ["none", "attnres", "full"],
    "dtype": ["fp32", "bf16"],
    "compile": ["off", "layer"],
}
LAYOUTS = {"pp2": (2, 1, 1), "pp2-dp2": (2, 2, 1), "pp2-tp2": (2, 1, 2)}
# DualPipeV needs 2 * pp micro-batches per data-parallel rank: at dp = 2 they hold one sample
# each, which gives the same mean loss (equal micro-batches) as the reference's four of two
PER_LAYOUT = {"pp2-dp2": {"train.micro_batch_size": 1}}
SCHEDULES = {
    "1f1b": {},
    "dualpipev": {"parallel.schedule": "dualpipev"},
    "interleaved": {"parallel.schedule": "interleaved", "parallel.virtual_stages": 2},
}
# the ops a compiled layer runs, eagerly too (test_compile.py's pipeline case)
TRACED = {"model.attnres.impl": "twophase", "runtime.fused_norm": "off"}
COMPILED = {"runtime.compile": "layer", "runtime.compile_backend": "aot_eager"}


def world(case: dict) -> int:
    pp, dp, tp = LAYOUTS[case["layout"]]
    return pp * dp * tp


def cost(case: dict) -> float:
    """Measured shape of a case's time: four ranks on two cores, and tracing, cost most."""
    return world(case) / 2 * (2.5 if case["compile"] == "layer" else 1.0)


CASES = covering_cases(FACTORS, cost=cost)


def name(case: dict) -> str:
    return "-".join(str(case[f]) for f in FACTORS)


def case_args(case: dict, data: str, run_dir: str) -> list[str]:
    pp, dp, tp = LAYOUTS[case["layout"]]
    extra = {**SCHEDULES[case["schedule"]], **PER_LAYOUT.get(case["layout"], {})}
    extra["parallel.recompute"] = case["recompute"]
    if case["dtype"] == "bf16":
        extra["runtime.dtype"] = "bf16"
    if case["compile"] == "layer":
        extra |= TRACED | COMPILED
    return overrides(data, case["mode"], run_dir, pp=pp, dp=dp, tp=tp, **extra)


def reference_key(case: dict) -> str:
    return f"{case['mode']}-{'traced' if case['compile'] == 'layer' else 'default'}"


@pytest.fixture(scope="module")
def grid(small_dataset, tmp_path_factory):
    """Every case's result and the references, from one launch per world size."""
    tmp = tmp_path_factory.mktemp("grid")
    references = {}
    for case in CASES:
        ops = TRACED if case["compile"] == "layer" else {}
        key = reference_key(case)
        references[key] = overrides(small_dataset, case["mode"], str(tmp / "r" / key), **ops)
    results = {"reference": train_cases(tmp / "references", references, nproc=1)}
    for size in sorted({world(case) for case in CASES}):
        cases = {
            name(c): case_args(c, small_dataset, str(tmp / "runs" / name(c)))
            for c in CASES
            if world(c) == size
        }
        results |= train_cases(tmp / f"world{size}", cases, nproc=size)
    return results


def test_cases_cover_every_pair_of_factors():
    """Every pair of levels of two factors is in some case, in a tenth of the product or less."""
    assert covered_pairs(CASES) == pairs(FACTORS)
    assert len(CASES) <= math.prod(len(levels) for levels in FACTORS.values()) / 10


@pytest.mark.parametrize("case", CASES, ids=name)
def test_case_matches_single_process(case, grid):
    result = result_of(grid, name(case))
    reference = result_of(grid["reference"], reference_key(case))
    if case["dtype"] == "fp32":
        assert_matches(result, reference, f"grid {name(case)}")
    else:
        assert_tracks_fp32(result, reference)
