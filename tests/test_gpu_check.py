"""The prepared GPU check's CPU dry run: the same driver, install steps and step code as on the GPU.

``GPU_CHECK_DRY_RUN=1 bash launch/gpu_check.sh`` builds the check's virtualenv over this
environment, resolves docker/requirements.py's list and the project with pip (``--dry-run``),
runs docker/check_base.py (which must refuse this CPU-only base), and then every step with
tiny sizes on the CPU: machine report, training smoke, step times of baseline / Block / Full,
depth-attention timings, export + generate, and ``pytest -m cuda`` (all skipped, with reason).
The test checks each step's record and the gpu.md written from them.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import REPO, VENV_BIN, child_env


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    from gpu_check.run import STEPS

    out = tmp_path_factory.mktemp("gpu_check")
    env = child_env()
    env.update(GPU_CHECK_DRY_RUN="1", PYTHON=str(VENV_BIN / "python"), OUT=str(out))
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        # every step but the speed steps, whose dry run has its own test
        [
            "bash",
            "launch/gpu_check.sh",
            "--only",
            *(s.name for s in STEPS if "speed" not in s.name),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    summary = json.loads((out / "gpu_check.json").read_text())
    return summary, {s["name"]: s for s in summary["steps"]}, (out / "gpu.md").read_text()


@pytest.mark.slow
def test_dry_run_installs_like_the_dockerfile(dry_run):
    summary, steps, _ = dry_run
    assert summary["dry_run"] is True
    for name in ("venv", "requirements", "project"):
        assert steps[name]["status"] == "ok", steps[name]
    assert "deepspeed==0.19.8" in steps["requirements"]["requirements"]
    assert not any(r.startswith("torch") for r in steps["requirements"]["requirements"])
    # a CPU-only torch without TE and apex is not a base the image can be built on
    assert steps["check_base"]["status"] == "failed"
    assert "CPU-only build" in steps["check_base"]["tail"]


@pytest.mark.slow
def test_dry_run_runs_every_step_and_skips_only_what_needs_cuda(dry_run):
    _, steps, md = dry_run
    for name in ("machine", "train_tiny", "generate", "step_time", "train_125m"):
        assert steps[name]["status"] == "ok", steps[name].get("tail")
    for name in ("depth_attention", "cuda_tests", "step_profile"):
        assert steps[name]["status"] == "ok", steps[name].get("tail")
    tiny = steps["train_tiny"]["result"]
    assert tiny["local"]["steps"] == 3 and tiny["local"]["final_loss"] > 0
    assert "Transformer Engine spec" in tiny["te"]["skipped"]
    times = steps["step_time"]["result"]
    assert times["baseline"]["vs_baseline"] == 1.0
    assert times["block"]["step_ms"] > 0 and times["full"]["step_ms"] > 0
    assert times["moe_baseline"]["vs_baseline"] == 1.0 and times["moe_block"]["step_ms"] > 0
    gen = steps["generate"]["result"]
    assert gen["device"] == "cpu" and gen["cli"][0]["text"].startswith("def ")
    assert gen["kv_cache"]["tokens_per_s"] > 0 and gen["recompute"]["tokens_per_s"] > 0
    registry = steps["depth_attention"]["result"]["registry"]
    assert {"lean", "reference"} <= {r["impl"] for r in registry if "fwd_bwd_ms" in r}
    profile = {(r["mode"], r["impl"]): r for r in steps["step_profile"]["result"]["runs"]}
    assert profile["block", "twophase"]["step_ms"] > 0 and profile["block", "twophase"]["top"]
    assert "needs a CUDA device" in profile["block", "triton"]["skipped"]
    cuda = steps["cuda_tests"]["result"]["counts"]
    assert cuda.get("skipped", 0) >= 1 and not cuda.get("failed")
    for heading in ("## Steps", "## Machine", "## Step time", "## Generate", "## Running it"):
        assert heading in md
    assert 'carry:     [".whl"]' in md


def _wheel(folder, name: str, requires: str):
    """A minimal pure-Python wheel of ``name`` 1.0 that requires ``requires``."""
    import zipfile

    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
        f"Requires-Dist: {requires}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for p, text in files.items():
            zf.writestr(p, text)
    return path


def test_unresolvable_wheels_are_installed_without_deps_and_the_conflict_reported(tmp_path):
    """On the GPU image, pins of its own can leave pip no solution for the carried wheels;
    the check then installs them with --no-deps (a real pip into a real venv) and says so."""
    import io

    from gpu_check import run

    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "carriedpkg", "absent-dependency>=1")
    venv = tmp_path / "venv"
    log = io.StringIO()
    assert run.make_venv(venv, log, 120)[0] == "ok"  # the check's own venv, over this one's
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "--no-index", "--find-links", wheels, "carriedpkg"]
    status, _, tail = run._run(pip, log, 120)
    assert status == "failed" and "absent-dependency" in tail  # the resolver's refusal
    record = run._install_carried(py, wheels, log, tail, 120)
    assert record["status"] == "ok", record
    assert "installed the carried wheels with --no-deps" in record["note"]
    assert "absent-dependency" in record["note"]  # pip check's complaint, named
    probe = subprocess.run(
        [py, "-c", "import carriedpkg; print(carriedpkg.VALUE)"], capture_output=True, text=True
    )
    assert probe.stdout.strip() == "1", probe.stderr


def test_a_step_past_its_limit_is_killed_with_what_it_started_and_its_output_kept():
    """An orphan of a timed-out step (its pytest, say) would share the GPU with the next."""
    import io
    import time
    from pathlib import Path

    from gpu_check import run

    log = io.StringIO()
    script = "sleep 60 & echo child=$!; wait"
    start = time.monotonic()
    status, rc, tail = run._run(["bash", "-c", script], log, 2)
    assert status == "timeout" and rc is None
    assert time.monotonic() - start < 30
    pid = int(tail.split("child=")[1].split()[0])
    time.sleep(0.2)
    stat = Path(f"/proc/{pid}/stat")
    # gone, or a zombie where the container's init does not reap orphans
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert "[timed out after 2 s]" in log.getvalue()


def test_the_report_renders_rows_cut_short_and_a_partial_profile():
    """A registry row skipped at the step's limit has no device or shape; a profile cut at its
    limit has the runs it measured. The report shows both instead of failing on them."""
    from gpu_check import report

    registry = [
        {"impl": "fla", "device": "cuda", "shape": [9, 8192, 768], "fwd_bwd_ms": 1.3},
        {"impl": "lean", "skipped": "the step's time limit"},
    ]
    runs = [
        {"mode": "baseline", "impl": "auto", "step_ms": 40.0, "busy_ms": 20.0, "top": []},
        {"mode": "block", "impl": "triton", "step_ms": 90.0, "busy_ms": 28.0,
         "top": [{"op": "_phase1_bwd", "calls": 8, "ms": 1.1}],
         "host": {"runtime_calls": 900.0, "launches": 800.0, "blocking": {
             "cudaStreamSynchronize": {"calls": 24, "ms": 40.5}}},
         "sync": {"syncs": 24, "sites": ["depth_state.py:88 x24"]}},
    ]  # fmt: skip
    steps = [
        {"name": "depth_attention", "what": "", "status": "ok", "result": {"registry": registry}},
        {"name": "step_profile", "what": "", "status": "timeout", "result": {
            "shape": "s", "runs": runs, "cut": "stopped at the step's time limit"}},
    ]  # fmt: skip
    summary = {"dry_run": False, "started": "t", "wall_s": 1, "budget_s": 2}
    md = report.markdown(summary | {"base_python": "3.12", "wheels": [], "steps": steps})
    assert "| lean |  |  |  |  |  | the step's time limit |" in md
    assert "stopped at the step's time limit" in md
    assert "| block | triton | 90.0 | 2.25 | 28.0 | _phase1_bwd 1.1 |  |" in md
    sync = "cudaStreamSynchronize 24 (40.5) | 24 | depth_state.py:88 x24 |"
    assert f"| block | triton | 900.0 | 800.0 | {sync}" in md


class _Event:
    def __init__(self, key: str, count: int, cpu_us: float = 0.0, device: bool = False):
        from torch.autograd import DeviceType

        self.key, self.count, self.cpu_time_total = key, count, cpu_us
        self.device_type = DeviceType.CUDA if device else DeviceType.CPU


class _Profile:
    def __init__(self, events):
        self.events = events

    def key_averages(self):
        return self.events


def test_host_calls_count_launches_and_blocking_calls_per_step():
    """Two profiled steps: 700 launches of two kinds, 6 stream syncs (3 ms of host time), one
    blocking memcpy; ops and async copies are not blocking, and device kernels whose names
    start with "cu" (cuDNN, CUTLASS) are not runtime calls."""
    from gpu_check.step_profile import _host_calls

    prof = _Profile(
        [
            _Event("cudaLaunchKernel", 600),
            _Event("cuLaunchKernel", 100),
            _Event("cudaStreamSynchronize", 6, 3000.0),
            _Event("cudaMemcpy", 2, 400.0),
            _Event("cudaMemcpyAsync", 10, 50.0),
            _Event("aten::mm", 300, 9000.0),
            _Event("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 24, device=True),
            _Event("cutlass_80_tensorop_s1688gemm", 40, device=True),
        ]
    )
    host = _host_calls(prof, steps=2)
    assert host["launches"] == 350 and host["memcpy_async"] == 5
    assert host["runtime_calls"] == (600 + 100 + 6 + 2 + 10) / 2
    assert host["blocking"] == {
        "cudaStreamSynchronize": {"calls": 3, "ms": 1.5},
        "cudaMemcpy": {"calls": 1, "ms": 0.2},
    }
    assert host["blocking_ms"] == 1.7


def test_sync_sites_name_the_lines_that_synchronise(monkeypatch):
    """torch's sync debug mode warns at each synchronising call; the sites are the warnings'
    lines, most frequent first, and the mode is restored afterwards."""
    import warnings

    import torch

    from gpu_check.step_profile import _sync_sites

    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    class Engine:
        def train_step(self, batch):
            assert modes[-1] == "warn"
            for _ in range(batch):
                warnings.warn_explicit(
                    "called a synchronizing CUDA operation", UserWarning, "engine.py", 76
                )
            warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "a.py", 9)
            warnings.warn("something else", stacklevel=1)

    sync = _sync_sites(Engine(), 3)
    assert sync == {"syncs": 4, "sites": ["engine.py:76 x3", "a.py:9 x1"]}
    assert modes[-1] == 0


@pytest.mark.slow
def test_speed_step_dry_run_measures_each_path_and_cuts_at_its_limit(tmp_path):
    """``speed_125m`` on the CPU at a tiny shape: ceilings, floors, the eager rows, the plain
    GPT, decode; the rest until the step's limit (compiled with aot_eager), then cut; graphed
    rows need CUDA. Its gpu.md section renders the table and the floors beside the values."""
    from gpu_check import report

    result_file = tmp_path / "speed.json"
    env = child_env()
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GPU_CHECK_STEP_S="120")
    cmd = [str(VENV_BIN / "python"), "-m", "gpu_check.steps", "speed_125m"]
    cmd += ["--work", str(tmp_path / "work"), "--result", str(result_file), "--dry-run"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(result_file.read_text())
    rows = {(r["kind"], r["micro_batch"], r["mode"], r["path"]): r for r in result["rows"]}
    for mb in (2, 1):
        for mode in ("baseline", "block", "full"):
            assert rows["model", mb, mode, "eager"]["step_s"] > 0
            graphed = rows["model", mb, mode, "graphed"]["skipped"]
            assert graphed in ("CUDA graphs need a CUDA device", "the step's time limit")
        assert rows["plain", mb, "plain", ""]["step_s"] > 0
    assert set(rows["decode", 0, "", ""]["decode"]) == {"baseline", "block"}
    # the first compiled row comes right after decode: reached well inside the limit
    assert rows["model", 2, "baseline", "compiled"]["step_s"] > 0
    assert rows["model", 2, "baseline", "graphed"]["skipped"] == "CUDA graphs need a CUDA device"
    assert result["ceilings"]["matmul_tflops"] > 0 and set(result["floors"]) == {"2", "1"}
    floors = {c["floor"] for c in result["checks"]}
    assert "decode Block / baseline time per token" in floors
    assert all(c["measured"] is not None for c in result["checks"])
    steps = [{"name": "speed_125m", "what": "", "status": "ok", "result": result}]
    summary = {"dry_run": True, "started": "t", "wall_s": 1, "budget_s": 2}
    md = report.markdown(summary | {"base_python": "3.12", "wheels": [], "steps": steps})
    assert "## Speed: eager, compiled, graphed, against a plain GPT" in md
    assert "| Block / baseline step time | 2 | <= 1.1 |" in md
    assert "Floors, counted before timing" in md


def test_speed_checks_hold_each_floor_to_the_fastest_path():
    """``speed_report.derive`` on hand-made rows: ratios of the fastest path of each mode,
    MFU from the floors, Block's extra time over its bytes floor, decode per token."""
    from gpu_check.speed_report import derive

    def row(mb, mode, path, step_s):
        kind = "plain" if mode == "plain" else "model"
        return {"kind": kind, "micro_batch": mb, "mode": mode, "path": path, "step_s": step_s}

    rows = [
        row(32, "baseline", "eager", 0.100), row(32, "baseline", "compiled", 0.080),
        row(32, "block", "eager", 0.120), row(32, "block", "compiled", 0.086),
        row(32, "full", "eager", 0.130), row(32, "plain", "", 0.076),
        row(8, "baseline", "eager", 0.030), row(8, "block", "eager", 0.036),
        {"kind": "decode", "micro_batch": 0, "mode": "", "path": "", "decode": {
            "baseline": {"tokens_per_s": 100.0}, "block": {"tokens_per_s": 80.0}}},
    ]  # fmt: skip
    floors = {
        "32": {"flops": 40e12, "block_extra_floor_ms": 2.0},
        "8": {"flops": 10e12, "block_extra_floor_ms": 0.5},
    }
    result = {"step": "speed_125m", "shape": {"seq": 1000, "micro_batches": [32, 8]}}
    result |= {"ceilings": {"matmul_tflops": 800.0}, "floors": floors, "rows": rows}
    out = derive(result)
    checks = {(c["floor"], c["micro_batch"]): c for c in out["checks"]}
    block32 = checks["Block / baseline step time", 32]
    assert block32["measured"] == round(0.086 / 0.080, 3) and block32["holds"]  # 1.075 <= 1.10
    assert checks["Block / baseline step time", 8]["measured"] == 1.2
    assert checks["Block / baseline step time", 8]["holds"] is False  # 1.2 > 1.15
    full = checks["Full / baseline step time", 32]
    assert full["measured"] == round(0.130 / 0.080, 3) and full["holds"] is False
    plain = checks["baseline / plain GPT tokens/s", 32]
    assert plain["measured"] == 0.95 and plain["holds"]  # 0.076 / 0.080 >= 0.9
    decode = checks["decode Block / baseline time per token", None]
    assert decode["measured"] == 1.25 and decode["holds"] is False
    table = {(t["micro_batch"], t["mode"], t["path"]): t for t in out["table"]}
    compiled = table[32, "baseline", "compiled"]
    assert compiled["tokens_per_s"] == 400000 and compiled["mfu"] == 0.625  # 40e12/0.08/800e12
    assert table[32, "block", "compiled"]["vs_baseline"] == 1.075
    assert table[32, "block", "compiled"]["block_extra_ms"] == 6.0
    assert table[32, "block", "compiled"]["block_extra_vs_floor"] == 3.0
