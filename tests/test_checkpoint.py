"""Checkpoints in real training runs: exact resume, resharding, and an elastic restart.

The reference is an uninterrupted 2-stage pipeline run (fp32, gloo) of 5 steps that saves at
steps 2, 4 and 5. From its step-2 checkpoint:

* the same layout continues bitwise (checked inside the elastic run below, and in one process
  with dropout on, so the RNG states must be restored too);
* pp = 1, 3, 4 and dp = 2 x tp = 2 continue with the reference's losses, and end with its
  parameters and AdamW moments, within TOL (model AND optimizer state reshard);
* a ``dualpipev`` or ``interleaved`` run resumes from it, and a 1F1B run from that run's own
  step-4 checkpoint, both on the reference within TOL (checkpoints do not depend on the
  schedule);
* under ``torchrun --max-restarts=1``, rank 1 is SIGKILLed while writing the step-4 checkpoint;
  the job restarts, ignores the unfinished save, resumes from step 2 and ends bitwise on the
  reference's losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from attnres_dist.checkpoint import store
from attnres_dist.checkpoint.state import read_tensors
from attnres_dist.cli import main
from tests.conftest import REPO, VENV_BIN, run_job
from tests.equivalence_helpers import overrides

TOL = 1e-5
STEPS, EVERY, RESUME_AT = 5, 2, 2
REACHED = os.environ.get("ATTNRES_TOLERANCE_LOG")  # optional: append reached diffs (JSONL)


def args_for(data: str, run_dir, pp=1, dp=1, tp=1, **extra) -> list[str]:
    extra = {"train.steps": STEPS, "checkpoint.every": EVERY, "checkpoint.keep_last": 5, **extra}
    return overrides(data, "block", str(run_dir), pp=pp, dp=dp, tp=tp, **extra)


@contextlib.contextmanager
def in_process():
    """One intra-op thread, like the launched ranks (OMP_NUM_THREADS=1; two threads made runs
    about 7x slower on a busy 2-core machine), and the environment restored afterwards: a run
    exports RANK, WORLD_SIZE and MASTER_PORT, which later child processes must not inherit."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)


def train(run_dir, args: list[str], nproc: int) -> dict:
    """One run: in this process for a world of one, else under torchrun. Its summary."""
    if nproc == 1:
        with in_process():
            assert main(["train", *args]) == 0
    else:
        run_job(["-m", "attnres_dist.cli", "train", *args], nproc=nproc)
    return json.loads((run_dir / "summary.json").read_text())


MOMENT_FLOOR = 1e-2  # see state_diffs


def final_state(run_dir) -> dict[str, torch.Tensor]:
    ckpt = store.resolve(run_dir, print)
    assert ckpt.step == STEPS
    return read_tensors(ckpt, prefix="")


@pytest.fixture(scope="module")
def reference(small_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    summary = train(run_dir, args_for(small_dataset, run_dir, pp=2), nproc=2)
    return {"dir": run_dir, "summary": summary, "state": final_state(run_dir)}


def resume_point(reference) -> str:
    return str(reference["dir"] / "checkpoints" / store.step_name(RESUME_AT))


def state_diffs(state: dict, ref: dict) -> dict[str, float]:
    """Largest difference per kind of tensor, relative to the largest reference value.

    The scale of a tensor is its own largest value, but at least ``MOMENT_FLOOR`` times the
    largest value of its kind over the whole model. Adam's moments of the norms' gains and of the
    depth-attention key norms and queries are 1e-3 .. 1e-4 of the largest first moment (less for
    the second): their gradients are sums over every token that nearly cancel, so a layout that
    changes the fp32 summation order moves them by ~1e-5 of their own size. Against the floor a
    wrong gradient in any tensor above 1e-4 of the largest still shows as >= 1e-2.
    """
    assert state.keys() == ref.keys()
    kinds = {
        key: "model" if key.startswith("model/") else "/".join(key.split("/")[:2]) for key in ref
    }
    largest: dict[str, float] = {}
    for key, value in ref.items():
        largest[kinds[key]] = max(largest.get(kinds[key], 0.0), value.abs().max().item())
    worst: dict[str, float] = {}
    for key, value in ref.items():
        kind = kinds[key]
        scale = max(value.abs().max().item(), MOMENT_FLOOR * largest[kind], 1e-30)
        diff = (state[key].double() - value.double()).abs().max().item() / scale
        worst[kind] = max(worst.get(kind, 0.0), diff)
    return worst


def test_exact_resume_same_layout_with_dropout(small_dataset, tmp_path):
    """One process, dropout on: stopped after step 2 and resumed == uninterrupted, bitwise."""
    dropout = {"model.attention_dropout": 0.1, "model.hidden_dropout": 0.1}
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "resumed"
    ref = train(ref_dir, args_for(small_dataset, ref_dir, **dropout), 1)
    start = str(ref_dir / "checkpoints" / store.step_name(RESUME_AT))
    resumed = train(
        run_dir, args_for(small_dataset, run_dir, **dropout, **{"checkpoint.resume": start}), 1
    )
    assert resumed["start_step"] == RESUME_AT
    assert resumed["train_losses"] == ref["train_losses"][RESUME_AT:]
    assert resumed["final_valid_loss"] == ref["final_valid_loss"]
    ours, theirs = final_state(run_dir), final_state(ref_dir)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def unpacked_copy(ckpt, root) -> str:
    """``ckpt`` rewritten under ``root`` as checkpoints were before the depth mixers were
    packed: each ``mixer_weights`` row a pair of ``<mixer>.query`` and
    ``<mixer>.key_norm_weight`` (the layers' ``attn_mixer``, ``mlp_mixer``; the final
    aggregation's ``mixer``), for the parameter and each AdamW state entry."""
    import safetensors.torch

    tmp = store.begin(root, ckpt.step)
    files = {}
    for name, info in ckpt.manifest["files"].items():
        data = (ckpt.path / name).read_bytes()
        if "tensors" in info:
            tensors = {}
            for key, value in safetensors.torch.load(data).items():
                if not key.endswith(".mixer_weights"):
                    tensors[key] = value
                    continue
                head = key[: -len("mixer_weights")]
                mixers = ["mixer"] if head.endswith("final.") else ["attn_mixer", "mlp_mixer"]
                for row, mixer in enumerate(mixers):
                    for column, part in enumerate(("query", "key_norm_weight")):
                        whole = value.dim() == 0  # AdamW's step count
                        tensors[f"{head}{mixer}.{part}"] = (
                            value if whole else value[row, column]
                        ).clone()
            data = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()})
        files[name] = store.write_bytes(tmp / name, data)
        if "tensors" in info:
            files[name]["tensors"] = {k: list(v.shape) for k, v in tensors.items()}
    body = {k: v for k, v in ckpt.manifest.items() if k not in ("format", "step", "files")}
    body.pop("checksum", None)
    return str(store.commit(root, ckpt.step, files, body))


def test_resume_from_a_checkpoint_with_unpacked_mixers(small_dataset, tmp_path):
    """A checkpoint written with four parameters per layer for the depth mixers (and two for
    the final aggregation's) resumes bitwise as the packed checkpoint it was rewritten from,
    optimizer state included; exporting reads it too."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "resumed"
    ref = train(ref_dir, args_for(small_dataset, ref_dir), 1)
    packed = store.resolve(ref_dir / "checkpoints" / store.step_name(RESUME_AT), print)
    start = unpacked_copy(packed, tmp_path / "old")
    old = store.resolve(start, print)
    assert "model/layers.0.attn_mixer.query" in old.tensor_index()
    assert "optim/exp_avg/final.mixer.key_norm_weight" in old.tensor_index()
    assert "model/layers.0.mixer_weights" not in old.tensor_index()
    read = read_tensors(old, prefix="model/")
    for key, value in read_tensors(packed, prefix="model/").items():
        assert torch.equal(read[key], value), key
    args = args_for(small_dataset, run_dir, **{"checkpoint.resume": start})
    resumed = train(run_dir, args, 1)
    assert resumed["start_step"] == RESUME_AT
    assert resumed["train_losses"] == ref["train_losses"][RESUME_AT:]
    ours, theirs = final_state(run_dir), final_state(ref_dir)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


LAYOUTS = [(1, 1, 1), (3, 1, 1), (4, 1, 1), (1, 2, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "pp{}-dp{}-tp{}".format(*t))
def test_reshard_from_two_stages(layout, reference, small_dataset, tmp_path):
    pp, dp, tp = layout
    run_dir = tmp_path / "run"
    resume = {"checkpoint.resume": resume_point(reference)}
    args = args_for(small_dataset, run_dir, pp=pp, dp=dp, tp=tp, **resume)
    summary = train(run_dir, args, nproc=pp * dp * tp)
    assert summary["start_step"] == RESUME_AT
    expected = reference["summary"]["train_losses"][RESUME_AT:]
    loss_diff = max(abs(a - b) for a, b in zip(summary["train_losses"], expected, strict=True))
    diffs = state_diffs(final_state(run_dir), reference["state"])
    if REACHED:
        with open(REACHED, "a") as fh:
            record = {"case": f"reshard pp2 -> pp={pp} dp={dp} tp={tp}", "loss": loss_diff}
            fh.write(json.dumps({**record, **diffs}) + "\n")
    torch.testing.assert_close(
        torch.tensor(summary["train_losses"], dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        atol=TOL,
        rtol=TOL,
    )
    for kind, diff in diffs.items():
        assert diff < TOL, f"{kind}: relative difference {diff:.3g}"
    assert diffs["optim/step"] == 0.0  # AdamW's step count carried over exactly


@pytest.mark.slow
def test_elastic_restart_after_a_rank_is_killed_while_saving(reference, small_dataset, tmp_path):
    run_dir = tmp_path / "run"
    marker = tmp_path / "killed-once"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # DESIGN.md section 4: gloo after a restart
        ATTNRES_FAULT=f"kill:mid-save:1:4:{marker}",
    )
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--standalone",  # its own free port
        "-m",
        "attnres_dist.cli",
        "train",
        *args_for(small_dataset, run_dir, pp=2),
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    out = proc.stdout + proc.stderr
    tail = "\n".join(out.splitlines()[-40:])
    assert proc.returncode == 0, tail
    assert "fault injection: kill rank 1 at mid-save of step 4" in out, tail
    step2 = run_dir / "checkpoints" / store.step_name(RESUME_AT)
    assert f"resumed from {step2} at step {RESUME_AT} (RNG states restored)" in out, tail
    summary = json.loads((run_dir / "summary.json").read_text())
    ref = reference["summary"]
    assert summary["start_step"] == RESUME_AT
    assert summary["train_losses"] == ref["train_losses"][RESUME_AT:]  # bitwise
    assert summary["final_train_loss"] == ref["final_train_loss"]
    assert summary["final_valid_loss"] == ref["final_valid_loss"]
    assert [s for s, _ in store.step_dirs(run_dir / "checkpoints")] == [5, 4, 2]
    for _, path in store.step_dirs(run_dir / "checkpoints"):
        store.verify(path)
    print(f"elastic run losses {summary['train_losses']}", file=sys.stderr)


VIRTUAL = {
    "dualpipev": {"parallel.schedule": "dualpipev"},
    "interleaved": {"parallel.schedule": "interleaved", "parallel.virtual_stages": 2},
}


def assert_continues(summary: dict, reference, start: int, label: str, run_dir) -> None:
    """Losses from ``start`` on and the final model + optimizer state match the reference."""
    assert summary["start_step"] == start
    expected = reference["summary"]["train_losses"][start:]
    loss_diff = max(abs(a - b) for a, b in zip(summary["train_losses"], expected, strict=True))
    diffs = state_diffs(final_state(run_dir), reference["state"])
    if REACHED:
        with open(REACHED, "a") as fh:
            fh.write(json.dumps({"case": label, "loss": loss_diff, **diffs}) + "\n")
    assert loss_diff <= TOL * (1 + max(abs(x) for x in expected)), f"{label}: {loss_diff}"
    for kind, diff in diffs.items():
        assert diff < TOL, f"{label}: {kind}: relative difference {diff:.3g}"
    assert diffs["optim/step"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(VIRTUAL))
def test_virtual_schedules_interchange_checkpoints(schedule, reference, small_dataset, tmp_path):
    """A virtual-stage run resumes from the 1F1B reference's step-2 checkpoint, and a 1F1B run
    resumes from that run's step-4 checkpoint: both continue on the uninterrupted reference."""
    virtual_dir, back_dir = tmp_path / "virtual", tmp_path / "back"
    resume = {"checkpoint.resume": resume_point(reference), **VIRTUAL[schedule]}
    summary = train(virtual_dir, args_for(small_dataset, virtual_dir, pp=2, **resume), 2)
    assert_continues(summary, reference, RESUME_AT, f"1f1b -> {schedule}", virtual_dir)
    step4 = str(virtual_dir / "checkpoints" / store.step_name(2 * EVERY))
    args = args_for(small_dataset, back_dir, pp=2, **{"checkpoint.resume": step4})
    summary = train(back_dir, args, 2)
    assert_continues(summary, reference, 2 * EVERY, f"{schedule} -> 1f1b", back_dir)
