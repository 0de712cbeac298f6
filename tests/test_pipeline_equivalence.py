"""Every parallel layout reproduces the single-process reference (fp32, real processes, gloo).

For each residual mode and each (pp, dp, tp) layout, a real DeepSpeed pipeline job under
torchrun (the cases of one world size in one launch: ``workers/train_cases.py``) trains 3
optimizer steps on the same data as the single-process reference, with
gradient clipping active. Per-step losses and every final parameter (gathered over tensor ranks
and stages, by canonical name) must match within TOL. The block size (3 sublayers) makes stage
boundaries fall inside blocks, so partial blocks cross them.
"""

from __future__ import annotations

import pytest

from tests.equivalence_helpers import (
    MODES,
    assert_matches,
    overrides,
    reference_runs,
    result_of,
    selected_params,
    single_process_reference,
    train_case,
    train_cases,
)

LAYOUTS = [(2, 1, 1), (3, 1, 1), (4, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]


RECOMPUTE = [("attnres", 1), ("full", 1), ("full", 2)]


def layout_name(mode: str, layout: tuple) -> str:
    return "{}-pp{}-dp{}-tp{}".format(mode, *layout)


def recompute_name(recompute: tuple) -> str:
    return "block-recompute-{}-{}".format(*recompute)


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory, request):
    """The selected cases of this module and the references, one launch per world size."""
    tmp = tmp_path_factory.mktemp("layouts")
    cases: dict[int, dict[str, list[str]]] = {}
    for params in selected_params(request, "test_layout_matches_reference"):
        mode, layout = params["mode"], params["layout"]
        name = layout_name(mode, layout)
        pp, dp, tp = layout
        args = overrides(small_dataset, mode, str(tmp / name), pp=pp, dp=dp, tp=tp)
        cases.setdefault(pp * dp * tp, {})[name] = args
    for params in selected_params(request, "test_pipelined_recompute_matches_reference"):
        mode, interval = params["recompute"]
        extra = {"parallel.recompute": mode, "parallel.recompute_interval": interval}
        name = recompute_name(params["recompute"])
        cases.setdefault(2, {})[name] = overrides(
            small_dataset, "block", str(tmp / name), pp=2, **extra
        )
    results = {"reference": reference_runs(small_dataset, tmp / "reference")}
    for size, named in sorted(cases.items()):
        results |= train_cases(tmp / f"world{size}", named, nproc=size)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "pp{}-dp{}-tp{}".format(*t))
@pytest.mark.parametrize("mode", MODES)
def test_layout_matches_reference(mode, layout, runs):
    result = result_of(runs, layout_name(mode, layout))
    assert_matches(result, runs["reference"][mode], layout_name(mode, layout))


@pytest.mark.slow
@pytest.mark.parametrize("recompute", RECOMPUTE, ids=lambda r: f"{r[0]}-{r[1]}")
def test_pipelined_recompute_matches_reference(recompute, runs):
    result = result_of(runs, recompute_name(recompute))
    assert_matches(result, runs["reference"]["block"], recompute_name(recompute))


@pytest.mark.slow
def test_explicit_partition_and_untied_head(small_dataset, tmp_path):
    extra = {"model.tie_embeddings": False}
    reference = single_process_reference(small_dataset, tmp_path, **extra)
    args = overrides(
        small_dataset,
        "block",
        str(tmp_path / "p"),
        pp=3,
        **extra,
        **{"parallel.partition": "[1,2,1]"},
    )
    assert_matches(train_case(tmp_path, "case", args, nproc=3), reference, "untied pp=3 [1,2,1]")
