"""The GPU kernel benchmark's CPU dry run: the same code path at tiny shapes."""

from __future__ import annotations

import json
import os

import pytest

from bench import kernel_bench


def test_dry_run_measures_every_available_impl(tmp_path):
    pytest.importorskip("triton")
    from attnres_dist.ops.triton_kernels import interpreter_problem

    before = os.environ.get("TRITON_INTERPRET")
    result = kernel_bench.run(tmp_path, dry_run=True)
    assert (
        os.environ.get("TRITON_INTERPRET") == before
    )  # the interpreter is switched on only inside
    assert json.loads((tmp_path / "kernel_bench.json").read_text()) == result
    assert result["dry_run"] and result["device"] == "cpu"
    status = result["impls"]
    assert status["reference"] is None and status["lean"] is None
    assert (status["triton"] is None) == (interpreter_problem() is None)
    for name in ("fla", "flash_attn_res"):
        assert status[name]  # a one-line reason on a machine without CUDA
    measured = {(r["impl"], r["dtype"]) for r in result["results"] if "fwd_bwd_ms" in r}
    usable = [name for name, why in status.items() if why is None]
    assert measured == {(name, dt) for name in usable for dt in ("float32", "bfloat16")}
    for row in result["results"]:
        assert "error" not in row, row
        assert row["fwd_bwd_ms"] >= row["forward_ms"] > 0
        assert row["max_abs_err_vs_reference"] <= (1e-5 if row["dtype"] == "float32" else 5e-2)
    assert set(result["ratios_vs_lean"]["S=3 T=12 D=32 float32"]) == set(usable) - {"lean"}
    table = kernel_bench.markdown_table(result)
    assert table.count("| triton |") == (2 if status["triton"] is None else 0)
    assert "`fla`: " in table


def test_unregistered_impls_are_listed_with_a_reason():
    status = kernel_bench.impl_status(("lean", "no_such_impl"))
    assert status == {"lean": None, "no_such_impl": "not registered"}
