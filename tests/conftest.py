"""Shared fixtures: a small prepared dataset, free ports, a runner for multi-process jobs, and a
simulated machine for the runtime selection (``machine``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from attnres_dist.parallel.launch_env import free_port

# the shared comparison helpers assert too: give their failures pytest's detailed messages
pytest.register_assert_rewrite("tests.equivalence_helpers")

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# Set in this process by in-process runs (init_distributed exports them); a child must not
# inherit a rendezvous port that this process still holds.
RENDEZVOUS_VARS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
}


def child_env() -> dict[str, str]:
    """This process's environment without the rendezvous variables (``RENDEZVOUS_VARS``)."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}


# A model small enough for multi-process tests; block size 3 puts stage cuts inside blocks.
TINY_MODEL = (
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "model.attnres.block_size=3",
    "train.steps=10",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "optim.warmup_steps=1",
)


@pytest.fixture
def machine(monkeypatch):
    """``machine(cuda=True, transformer_engine=False, ...)``: set what the probes report.

    Returns the list of probes called, so tests can check that nothing was probed needlessly.
    """
    from attnres_dist.runtime import probes
    from tests.simulated_probes import MISSING, OK

    called: list[str] = []

    def configure(**available: bool):
        for name in OK:
            result = (OK if available.get(name, False) else MISSING)[name]

            def probe(name=name, result=result):
                called.append(name)
                return result

            monkeypatch.setattr(probes, name, probe)
        return called

    return configure


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=("fast", "rest", "full"),
        default="full",
        help="fast: make test's tier; rest: the full tier's tests that are not fast; full: all "
        "(tests/tiers.py)",
    )


def pytest_collection_modifyitems(config, items):
    """Keep the tests of the tier asked for (``--tier``, ``tests/tiers.py``); ``@pytest.mark.cuda``
    tests need a GPU: skipped, with the reason, where there is none."""
    import torch

    select_tier(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run by make gpu-check)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def select_tier(config, items) -> None:
    """Deselect what ``--tier`` leaves out, the heaviest files first (``tiers.HEAVY_FIRST``); a
    fast entry of ``tiers.FILES`` that names no test of its file is an error, so the fast tier
    cannot lose a test to a rename."""
    from tests import tiers

    # files collected in part (a test named on the command line) are not checked for names
    partial = {Path(arg.split("::")[0]).name for arg in config.args if "::" in arg}
    names: dict[str, list[str]] = {}
    for item in items:
        names.setdefault(item.path.name, []).append(item.name)
    for file, found in names.items():
        if file not in tiers.FILES:
            raise pytest.UsageError(f"tests/{file} is in no tier: assign it in tests/tiers.py")
        entries = tiers.FILES[file]
        stale = (
            []
            if isinstance(entries, str)
            else [e for e in entries if not any(tiers.matches(e, n) for n in found)]
        )
        if stale and file not in partial:
            raise pytest.UsageError(f"tests/tiers.py names tests {file} does not have: {stale}")
    heavy = {file: i for i, file in enumerate(tiers.HEAVY_FIRST)}
    items.sort(key=lambda item: heavy.get(item.path.name, len(heavy)))  # stable: files intact
    tier = config.getoption("--tier")
    if tier == "full":
        return
    keep, drop = [], []
    for item in items:
        fast = tiers.is_fast(item.path.name, item.name)
        (keep if fast == (tier == "fast") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> str:
    """A byte-level dataset of ~40 standard-library modules, prepared with prepare-data."""
    from attnres_dist.data import build_tokenizer, prepare_dataset

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:40]
    out = tmp_path_factory.mktemp("data") / "small"
    return prepare_dataset(files, str(out), build_tokenizer("bytes", None), valid_fraction=0.1)


LAUNCH_LOG = os.environ.get("ATTNRES_LAUNCH_LOG")  # optional: one JSON line per launch


def log_launch(args: list[str], nproc: int, wall: float) -> None:
    """Append the launch (test, script, ranks, wall seconds) to ``ATTNRES_LAUNCH_LOG``, if set:
    where the suite's time goes (docs/testing.md)."""
    if LAUNCH_LOG:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        line = {"test": test, "script": args[0], "nproc": nproc, "wall": round(wall, 2)}
        with open(LAUNCH_LOG, "a") as fh:
            fh.write(json.dumps(line) + "\n")


def run_job(args: list[str], nproc: int = 1, timeout: int = 600, env: dict | None = None):
    """Run ``python args...`` in one process, or under torchrun with ``nproc`` ranks."""
    full_env = child_env()
    full_env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # a worker script's own folder is its sys.path[0]: the repository root lets it import the
    # harness folders (bench/, gpu_check/), which the installed package does not hold
    full_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
    )
    full_env.update(env or {})
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            str(VENV_BIN / "torchrun"),
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            *args,
        ]
    started = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    log_launch(args, nproc, time.monotonic() - started)
    if proc.returncode != 0:
        lines = proc.stderr.splitlines()
        causes = [ln for ln in lines if any(k in ln for k in ("Error", "what()", "error:"))]
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- error lines ---\n"
            + "\n".join(causes[:30])
            + "\n--- stderr tail ---\n"
            + "\n".join(lines[-40:])
        )
    return proc


def pytest_sessionstart(session):
    session.config._tier_started = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The tier's wall time beside its budget (``tiers.py``), after the slowest tests."""
    from tests import tiers

    tier = config.getoption("--tier")
    wall = time.monotonic() - getattr(config, "_tier_started", time.monotonic())
    budget = {"fast": f", budget {tiers.FAST_BUDGET_S} s with set-up"}.get(tier, "")
    terminalreporter.write_line(f"tier {tier}: {wall:.0f} s of wall time{budget}")
