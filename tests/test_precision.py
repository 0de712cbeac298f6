"""DeepSpeed's bf16 engine and ZeRO-1 in real pipeline jobs (torchrun, gloo, DeepSpeed's CPU
accelerator), against the single-process fp32 reference.

* ZeRO-1 in fp32 (optimizer state sharded over dp = 2; and at pp = 2, where the tied embedding
  lives on both stages) reproduces the reference within the fp32 TOL, with clipping active
  (max norm 0.05): DeepSpeed's global norm counts every parameter once, tied copy included.
* The bf16 engine (bf16 parameters and payloads, fp32 master weights and accumulation) in one
  process and at pp = 2 tracks the fp32 losses over 3 steps within BF16_LOSS_TOL
  (``equivalence_helpers``); what the run reports as its parameters are the fp32 master weights.
* A bf16 checkpoint written at dp = 2 (ZeRO-1 sharded) is loaded at dp = 1 and at pp = 2 and
  saved again at once: every tensor (fp32 master weights, AdamW moments, step counts) is
  bitwise the same, so the state resumes exactly in another layout.
"""

from __future__ import annotations

import pytest
import torch

from attnres_dist.checkpoint import store
from attnres_dist.checkpoint.state import read_tensors
from tests.conftest import run_job
from tests.equivalence_helpers import assert_matches, assert_tracks_fp32, overrides, train_case

CLIP = {"optim.grad_clip": 0.05}


@pytest.fixture(scope="module")
def reference(small_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision_reference")
    return train_case(tmp, "ref", overrides(small_dataset, "block", str(tmp / "ref"), **CLIP), 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 2), (2, 1)], ids=["dp2", "pp2"])
def test_zero1_fp32_matches_reference(layout, reference, small_dataset, tmp_path):
    pp, dp = layout
    extra = {**CLIP, "parallel.zero_stage": 1}
    args = overrides(small_dataset, "block", str(tmp_path / "run"), pp=pp, dp=dp, **extra)
    result = train_case(tmp_path, "zero1", args, nproc=pp * dp)
    assert_matches(result, reference, f"zero1 pp={pp} dp={dp}")


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2], ids=["single", "pp2"])
def test_bf16_engine_tracks_fp32(pp, reference, small_dataset, tmp_path):
    extra = {**CLIP, "runtime.dtype": "bf16"}
    args = overrides(small_dataset, "block", str(tmp_path / "run"), pp=pp, **extra)
    result = train_case(tmp_path, "bf16", args, nproc=pp)
    assert_tracks_fp32(result, reference)


@pytest.mark.slow
def test_bf16_zero1_checkpoint_resumes_exactly_at_other_layouts(small_dataset, tmp_path):
    extra = {"runtime.dtype": "bf16", "train.steps": 2, "checkpoint.every": 0}
    saved = tmp_path / "dp2"
    args = overrides(small_dataset, "block", str(saved), dp=2, **extra)
    train_case(tmp_path, "dp2", args, nproc=2)
    original = store.newest_valid(saved / "checkpoints", print)
    assert original is not None and original.step == 2
    assert original.manifest["layout"]["dp"] == 2
    expected = read_tensors(original, prefix="")
    assert any(k.startswith("optim/exp_avg_sq/") for k in expected)
    assert all(t.dtype == torch.float32 for k, t in expected.items() if k.startswith("model/"))
    for name, (pp, dp) in {"dp1": (1, 1), "pp2": (2, 1)}.items():
        again = tmp_path / name
        resume = {**extra, "checkpoint.resume": str(original.path)}
        resume["checkpoint.dir"] = str(again)
        args = overrides(small_dataset, "block", str(tmp_path / f"run-{name}"), pp=pp, dp=dp)
        args += [f"{k}={v}" for k, v in resume.items()]
        run_job(["tests/workers/resave_case.py", *args], nproc=pp * dp)
        resaved = store.newest_valid(again, print)
        assert resaved is not None and resaved.manifest["layout"] == {"pp": pp, "dp": dp, "tp": 1}
        got = read_tensors(resaved, prefix="")
        assert got.keys() == expected.keys(), name
        for key, tensor in expected.items():
            assert torch.equal(got[key], tensor), (name, key)


@pytest.mark.slow
def test_profiler_measures_the_predicted_bf16_wire_bytes(small_dataset, tmp_path):
    """Under the bf16 engine the payloads are bf16: half the fp32 contract's bytes, exactly."""
    import json

    from attnres_dist.config import load_config
    from attnres_dist.pipeline.contract import boundary_specs_for_config
    from tests.test_profile import overrides as profile_overrides
    from tests.test_profile import profile_cli

    args = [*profile_overrides(small_dataset, str(tmp_path), 2), "runtime.dtype=bf16"]
    run_job([*profile_cli(2), *args], nproc=2)
    profile = json.loads((tmp_path / "comm_profile.json").read_text())
    cfg = load_config(None, args)
    bf16 = boundary_specs_for_config(cfg, 256, torch.bfloat16)  # uniform partition: vocab-free
    fp32 = boundary_specs_for_config(cfg, 256, torch.float32)
    assert len(profile["boundaries"]) == len(bf16) == 1
    for spec, spec32, row in zip(bf16, fp32, profile["boundaries"], strict=True):
        assert spec.dtype == "bfloat16" and 2 * spec.bytes_forward == spec32.bytes_forward
        for direction, expected in (
            ("forward", spec.bytes_forward),
            ("backward", spec.bytes_backward),
        ):
            assert row[direction]["measured_bytes_per_micro_batch"] == expected, direction
    assert profile["bytes_equal_contract"]
    for trace in profile["traces"].values():  # gloo's own byte counts agree
        assert trace["bytes_equal"], trace
