"""Every tensor handed to torch.distributed is on the run's device (parallel/comm_device.py).

NCCL refuses CPU tensors, so a tensor made without ``device=`` breaks the first GPU run while
every gloo test passes. ``CommDeviceCheck`` (parallel/comm_check.py) makes that visible on a CPU
machine: each torch.distributed call's tensors must be on the declared device, and a
``TorchFunctionMode`` marks tensors made on the default device (no ``device=``, or the CPU
named literally) so that they fail even though their physical device is the declared CPU.

* Real 2-rank gloo jobs (pp = 2 with the profiler's calibration and the benchmark's reduction;
  dp = 2), diagnostics and checkpoints on, run under the check: no violation, and every kind
  of call each layout makes was seen and its tensors checked (counts > 0).
* The check is not vacuous: a CPU tensor under a declared ``meta`` device, and tensors made
  without a device (or derived from one) under a declared CPU, are caught before the call.
* A static scan complements it: in every project function that calls a tensor collective or
  p2p, each tensor factory names a device that is not a string literal.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attnres_dist.parallel import comm_device
from attnres_dist.parallel.comm_check import TENSOR_CALLS, CommDeviceCheck, CommDeviceError
from tests.conftest import REPO, run_job
from tests.equivalence_helpers import overrides

# the calls each layout must make (and have checked); object collectives carry no tensor
EXPECTED = {
    (2, 1): {"send", "recv", "all_reduce", "broadcast"},
    (1, 2): {"all_reduce", "broadcast"},
}


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp", sorted(EXPECTED))
def test_every_collective_of_a_run_is_on_the_run_device(small_dataset, tmp_path, pp, dp):
    extra = {
        "metrics.every_k": 1,
        "checkpoint.every": 1,
        "train.steps": 2,
        "parallel.timeout_s": 600,  # a loaded 2-core machine: no early abort
    }
    args = overrides(small_dataset, "block", str(tmp_path / "run"), pp=pp, dp=dp, **extra)
    prefix = tmp_path / "report"
    run_job(["tests/workers/comm_device_case.py", str(prefix), *args], nproc=2)
    reports = [json.loads(Path(f"{prefix}.{r}.json").read_text()) for r in range(2)]
    calls, checked = {}, {}
    for report in reports:
        assert report["violations"] == [], report["violations"]
        assert report["declared"] == report["comm_device"] == "cpu"
        for kind, n in report["calls"].items():
            calls[kind] = calls.get(kind, 0) + n
        for kind, n in report["tensors_checked"].items():
            checked[kind] = checked.get(kind, 0) + n
    print(f"pp={pp} dp={dp}: calls {calls}; tensors checked {checked}")
    for kind in EXPECTED[(pp, dp)]:
        assert calls.get(kind, 0) > 0 and checked.get(kind, 0) > 0, (kind, calls, checked)
    assert calls.get("gather_object", 0) > 0  # diagnostics, checkpoint, full_state
    if pp == 2:
        assert calls.get("all_gather_object", 0) > 0  # the calibration's boot ids and links


class _Reached:
    """Stands in for a torch.distributed call under the check: records that a call got past
    the check, whatever process group this process has (none, or another test's)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1


@pytest.fixture
def reached(monkeypatch) -> _Reached:
    stub = _Reached()
    monkeypatch.setattr(dist, "all_reduce", stub)
    return stub


def test_a_cpu_tensor_under_a_non_cpu_device_is_caught(reached):
    with CommDeviceCheck("meta", strict=True, taint=False) as check:
        with pytest.raises(CommDeviceError, match=r"all_reduce got a tensor on cpu.*is meta"):
            dist.all_reduce(torch.zeros(2))
        with pytest.raises(CommDeviceError, match="send got a tensor on cpu"):
            dist.send(torch.ones(3, device=torch.device("cpu")), 1)
        with pytest.raises(CommDeviceError, match="all_gather got"):
            dist.all_gather([torch.zeros(2, device="meta")], torch.zeros(2))
        # a tensor on the declared device passes the check and reaches the call it wraps
        dist.all_reduce(torch.zeros(2, device="meta"))
        assert reached.calls == 1
    assert check.counts["all_reduce"] == 2 and check.counts["send"] == 1
    assert dist.all_reduce is reached  # uninstalled: the wrapped call is back


def test_tensors_made_on_the_default_device_are_caught(reached):
    device = comm_device.comm_device()
    assert device == torch.device("cpu")  # this machine; the taint plays the default device
    with CommDeviceCheck(device, strict=True):
        for bad in (
            lambda: torch.zeros(2),
            lambda: torch.tensor(3.0, dtype=torch.float64),
            lambda: torch.zeros(2).double().pow(2).sum(),  # computed from a default tensor
            lambda: torch.ones(2, device="cpu"),  # the CPU named literally
            lambda: torch.ones(2, device=device).cpu(),
        ):
            with pytest.raises(CommDeviceError, match="created on the default device"):
                dist.all_reduce(bad())
        goods = (
            lambda: torch.zeros(2, device=device),
            lambda: torch.zeros(2).to(device),
            lambda: torch.zeros(2, device=device) * torch.tensor(2.0),  # 0-dim CPU operand
        )
        for good in goods:
            dist.all_reduce(good())
        assert reached.calls == len(goods)


# ------------------------------------------------------------------------------ static scan

_FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn"}


def _is_dist_call(node: ast.Call) -> bool:
    f = node.func
    if not isinstance(f, ast.Attribute) or f.attr not in TENSOR_CALLS:
        return False
    v = f.value
    return (isinstance(v, ast.Name) and v.id == "dist") or (
        isinstance(v, ast.Attribute) and v.attr == "distributed"
    )


def _factory_problem(node: ast.Call) -> str | None:
    f = node.func
    if not (
        isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch"
    ):
        return None
    if f.attr.endswith("Tensor") and f.attr != "Tensor":
        return f"legacy constructor torch.{f.attr}"
    if f.attr not in _FACTORIES:
        return None
    device = next((k.value for k in node.keywords if k.arg == "device"), None)
    if device is None:
        return f"torch.{f.attr} without device="
    if isinstance(device, ast.Constant):
        return f"torch.{f.attr} with a literal device {device.value!r}"
    return None


def static_scan(root: Path) -> tuple[int, list[str]]:
    """(functions calling torch.distributed with tensors, problems found in them)."""
    functions, problems = 0, []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
            if not any(_is_dist_call(c) for c in calls):
                continue
            functions += 1
            for call in calls:
                problem = _factory_problem(call)
                if problem:
                    problems.append(f"{path.relative_to(root.parent)}:{call.lineno} {problem}")
    return functions, problems


def test_static_scan_finds_no_tensor_without_the_run_device():
    functions, problems = static_scan(REPO / "attnres_dist")
    assert functions >= 5  # clip, parameter count, calibration, benchmark, tensor gather
    assert problems == []


def test_static_scan_flags_the_pattern(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import torch\nimport torch.distributed as dist\n"
        "def f():\n    t = torch.tensor(1)\n    dist.all_reduce(t)\n"
        "def g(d):\n    t = torch.zeros(2, device='cpu')\n    dist.send(t, 1)\n"
        "def h(d):\n    t = torch.zeros(2, device=d)\n    dist.recv(t, 0)\n"
    )
    functions, problems = static_scan(pkg)
    assert functions == 3
    assert [p.split(" ", 1)[1] for p in problems] == [
        "torch.tensor without device=",
        "torch.zeros with a literal device 'cpu'",
    ]
