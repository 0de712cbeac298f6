"""Every parallel layout reproduces the single-process reference (fp32, real processes, gloo).

For each residual mode and each (pp, dp, tp) layout, a real DeepSpeed pipeline job under
torchrun trains 3 optimizer steps on the same data as the single-process reference, with
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
    single_process_reference,
    train_case,
)

LAYOUTS = [(2, 1, 1), (3, 1, 1), (4, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]


@pytest.fixture(scope="module")
def references(small_dataset, tmp_path_factory):
    return reference_runs(small_dataset, tmp_path_factory.mktemp("reference"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "pp{}-dp{}-tp{}".format(*t))
@pytest.mark.parametrize("mode", MODES)
def test_layout_matches_reference(mode, layout, references, small_dataset, tmp_path):
    pp, dp, tp = layout
    args = overrides(small_dataset, mode, str(tmp_path / "run"), pp=pp, dp=dp, tp=tp)
    result = train_case(tmp_path, "case", args, nproc=pp * dp * tp)
    assert_matches(result, references[mode], f"{mode} pp={pp} dp={dp} tp={tp}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "recompute", [("attnres", 1), ("full", 1), ("full", 2)], ids=lambda r: f"{r[0]}-{r[1]}"
)
def test_pipelined_recompute_matches_reference(recompute, references, small_dataset, tmp_path):
    mode, interval = recompute
    args = overrides(
        small_dataset,
        "block",
        str(tmp_path / "run"),
        pp=2,
        **{"parallel.recompute": mode, "parallel.recompute_interval": interval},
    )
    result = train_case(tmp_path, "case", args, nproc=2)
    assert_matches(result, references["block"], f"block pp=2 recompute={mode}/{interval}")


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
