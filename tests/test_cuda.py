"""GPU-only checks (``@pytest.mark.cuda``: skipped without a GPU; ``make gpu-check`` runs them).

* NCCL takes the tensors the project makes for collectives: with one GPU a world of one NCCL
  process is what can run; under ``CommDeviceCheck`` with the declared ``cuda:N`` device the
  benchmark's reduction and the parameter gather pass, and NCCL itself refuses a CPU tensor
  (the failure every tensor made with ``device=comm_device()`` avoids).
* The single-process model trains the same on the GPU as on the CPU: three fp32 steps of the
  same config, in a process that sees the GPU and one that does not, give the same losses.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, child_env, run_job

NCCL_WORLD_OF_ONE = """
import json, torch, torch.distributed as dist
from attnres_dist.parallel.comm_check import CommDeviceCheck
from attnres_dist.parallel.comm_device import comm_device
from attnres_dist.parallel.dims import ParallelDims
from attnres_dist.parallel.process_groups import init_distributed, shutdown_distributed
from attnres_dist.parallel.tp_shards import gather_full
init_distributed(ParallelDims(), device="cuda")
out = {"backend": dist.get_backend(), "device": str(comm_device())}
with CommDeviceCheck(comm_device(), strict=True) as check:
    from bench.launch_job import slowest_rank_seconds
    out["slowest"] = slowest_rank_seconds(1.5)
    t = torch.arange(6.0, device=comm_device())
    out["gather"] = gather_full(t).tolist()
    out["checked"] = dict(check.tensors_checked)
try:
    dist.all_reduce(torch.zeros(2))
    out["cpu_tensor"] = "accepted"
except Exception as exc:
    out["cpu_tensor"] = type(exc).__name__
shutdown_distributed()
print(json.dumps(out))
"""


@pytest.mark.cuda
def test_nccl_takes_the_tensors_made_on_the_run_device():
    proc = subprocess.run(
        [sys.executable, "-c", NCCL_WORLD_OF_ONE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["backend"] == "nccl" and out["device"].startswith("cuda:")
    assert out["slowest"] == 1.5 and out["gather"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert out["checked"]["all_reduce"] == 1
    assert out["cpu_tensor"] != "accepted"


@pytest.mark.cuda
def test_one_gpu_trains_like_the_cpu(small_dataset, tmp_path):
    from tests.equivalence_helpers import overrides

    losses = {}
    for where, env in (("gpu", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        args = overrides(small_dataset, "block", str(tmp_path / where))
        args += ["runtime.dtype=fp32", "runtime.layer_spec=local", "checkpoint.every=0"]
        run_job(["-m", "attnres_dist.cli", "train", *args], env=env)
        summary = json.loads((tmp_path / where / "summary.json").read_text())
        losses[where] = summary["train_losses"]
    assert len(losses["gpu"]) == 3
    for gpu, cpu in zip(losses["gpu"], losses["cpu"], strict=True):
        assert abs(gpu - cpu) <= 1e-3 * max(1.0, abs(cpu)), losses
