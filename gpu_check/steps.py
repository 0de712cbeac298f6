"""What each step of the GPU check does; run one per process by ``gpu_check.run``.

    python -m gpu_check.steps NAME --work DIR --result FILE [--dry-run]

Each step returns a JSON-able dict written to FILE; ``{"skipped": reason}`` says it could not
run here (CUDA missing in a dry run, an optional package absent). An exception fails the step
(exit 1, the traceback in the log). ``--dry-run`` runs the same code on the CPU with tiny sizes.
The training steps live in ``train_steps.py``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from gpu_check.common import save_result, step_limit_s
from gpu_check.run import run_group

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "torch",
    "triton",
    "deepspeed",
    "megatron-core",
    "transformer-engine",
    "apex",
    "flash-linear-attention",
    "fla-core",
    "transformers",
    "safetensors",
    "mpi4py",
)


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def machine(work: Path, dry: bool) -> dict:
    import torch

    from attnres_dist.config import RuntimeConfig
    from attnres_dist.runtime import select_runtime

    info = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "cpus": __import__("os").cpu_count(),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "versions": {name: _version(name) for name in PACKAGES},
        "runtime_auto": select_runtime(RuntimeConfig()).describe(),
    }
    try:  # the device DeepSpeed's accelerator names must be the run's (parallel/comm_device.py)
        from deepspeed.accelerator import get_accelerator

        from attnres_dist.parallel.comm_device import default_device

        info["deepspeed_accelerator"] = get_accelerator().current_device_name()
        info["comm_device"] = str(default_device())
    except Exception as exc:  # recorded, not fatal
        info["deepspeed_accelerator"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "bf16": torch.cuda.is_bf16_supported(),
        }
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = (smi.stdout or smi.stderr).strip().splitlines()[:20]
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = [f"not available: {exc}"]
    return info


# The project's own kernels first; the outside kernels (fla autotunes 24 configurations per new
# shape) last, so a run cut short by its time limit has tested the project's first.
TEST_ORDER = ("test_triton_two_phase.py", "test_cuda.py", "test_export.py")


def cuda_tests(work: Path, dry: bool) -> dict:
    """``pytest -m cuda`` over the test files that have such tests (on a CPU every one of them
    is skipped with its reason; ``GPU_CHECK_PYTEST_K`` narrows it with ``-k``). A failure's
    traceback is printed as it fails. It stops 15 s before the step's limit and reports what
    ran."""
    files = [
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if "pytest.mark.cuda" in p.read_text()
    ]
    files.sort(key=lambda f: (TEST_ORDER + (Path(f).name,)).index(Path(f).name))
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "cuda", "-rs"]
    cmd += ["-p", "gpu_check.pytest_now", "--tb=short", "--durations=10", *files]
    if os.environ.get("GPU_CHECK_PYTEST_K"):  # a rerun of chosen tests only
        cmd += ["-k", os.environ["GPU_CHECK_PYTEST_K"]]
    rc, out = run_group(cmd, max(step_limit_s(600) - 15, 10))
    timed_out = rc is None
    print(out, flush=True)  # every test's outcome into the check's log
    lines = out.strip().splitlines()
    outcomes = re.findall(r"^(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL)", out, re.M)
    counts = dict(Counter(outcome.lower() for _, outcome in outcomes))
    if timed_out:
        summary = "stopped at the step's time limit after " + (
            ", ".join(f"{v} {k}" for k, v in counts.items()) or "no test"
        )
    else:
        summary = lines[-1] if lines else ""
    result = {"files": files, "rc": rc, "summary": summary, "counts": counts}
    result["failed"] = [name for name, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    result["tail"] = lines[-25:]
    broke = not timed_out and rc not in (0, 5)  # 5: nothing collected
    if counts.get("failed") or counts.get("error") or broke:
        raise RuntimeError(f"pytest -m cuda: {summary}\n" + "\n".join(lines[-40:]))
    return result


def _depth_attention_timing(dry: bool, deadline: float) -> list[dict]:
    """fwd+bwd time and peak extra memory of each registered implementation on this device."""
    import torch

    from attnres_dist.ops import available_depth_attention_impls, get_depth_attention

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    # the 125M shape: 8 x 1024 tokens, hidden 768, 9 sources (8 blocks + the partial one)
    tokens, dim, n, dtype = (8192, 768, 9, torch.bfloat16) if cuda else (256, 64, 5, torch.float32)
    reps, warmup = (20, 3) if cuda else (3, 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    sources = [torch.randn(tokens, dim, generator=gen).to(device, dtype) for _ in range(n)]
    for s in sources:
        s.requires_grad_()
    query = (0.1 * torch.randn(dim, generator=gen)).to(device).requires_grad_()
    gain = torch.ones(dim, device=device, requires_grad=True)
    grad = torch.randn(tokens, dim, generator=gen).to(device, dtype)
    rows = []
    for name in available_depth_attention_impls():
        if time.monotonic() > deadline:
            rows.append({"impl": name, "skipped": "the step's time limit"})
            continue
        impl = get_depth_attention(name)
        why = impl.requirement() if device.type in impl.devices else f"no {device.type} support"
        row = {"impl": name, "device": str(device), "shape": [n, tokens, dim], "dtype": str(dtype)}
        if why:
            rows.append(row | {"skipped": why})
            continue
        times = []
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        try:
            for rep in range(warmup + reps):
                start = time.perf_counter()
                out = impl(query, sources, gain)
                torch.autograd.grad(out, [query, gain, *sources], grad)
                if cuda:
                    torch.cuda.synchronize()
                if rep >= warmup:
                    times.append(time.perf_counter() - start)
                del out
        except (ValueError, RuntimeError) as exc:  # a shape the kernel refuses (flash-attn-res)
            rows.append(row | {"skipped": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        row["fwd_bwd_ms"] = round(1e3 * statistics.median(times), 3)
        print(f"registry {name}: {row['fwd_bwd_ms']} ms", flush=True)
        if cuda:
            row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        rows.append(row)
    return rows


def depth_attention(work: Path, dry: bool) -> dict:
    """``bench.kernel_bench.run`` when it exists, and each registered implementation timed."""
    result = {}
    limit_s = step_limit_s(150)
    deadline = time.monotonic() + limit_s - 20  # the registry's timing stops here
    try:
        from bench import kernel_bench
    except ImportError as exc:
        result["kernel_bench"] = f"not available ({exc})"
    else:
        accepts = inspect.signature(kernel_bench.run).parameters
        # half the step's limit; the registry's timing below gets the rest
        budget = 30.0 if dry else max(limit_s / 2, 30.0)
        options = {"time_budget_s": budget} if "time_budget_s" in accepts else {}
        if "dry_run" in accepts:
            options["dry_run"] = dry
        elif dry:
            options = None  # no CPU mode: GPU only
        if options is None:
            result["kernel_bench"] = "present; no dry-run mode, so it runs on the GPU only"
        else:
            out = kernel_bench.run(str(work / "kernel_bench"), **options)
            result["kernel_bench"] = json.loads(json.dumps(out, default=str))
    result["registry"] = _depth_attention_timing(dry, deadline)
    return result


def _steps():
    from gpu_check import speed_step, step_profile, study_step, train_steps

    return {
        "machine": machine,
        "cuda_tests": cuda_tests,
        "depth_attention": depth_attention,
        "train_tiny": train_steps.train_tiny,
        "train_125m": train_steps.train_125m,
        "step_time": train_steps.step_time,
        "step_profile": step_profile.step_profile,
        "generate": train_steps.generate,
        "study": study_step.study_runs,
        "speed_125m": lambda work, dry: speed_step.speed("speed_125m", work, dry),
        "speed_125m_compiled": lambda work, dry: speed_step.speed("speed_125m_compiled", work, dry),
        "speed_1b": lambda work, dry: speed_step.speed("speed_1b", work, dry),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name")
    parser.add_argument("--work", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["GPU_CHECK_RESULT"] = args.result
    result = _steps()[args.name](work, args.dry_run)
    save_result(result)
    print(json.dumps(result, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
