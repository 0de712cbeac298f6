"""Guards: a non-finite loss stops a run cleanly; a stalled pipeline neighbour is named.

* An absurd learning rate (1e30) makes step 2's loss NaN: the run exits with code 3 and one
  line naming the step and the last good checkpoint (step 1), and saves nothing after it.
* In a 2-stage job, stage 0 stalls before step 2 (test-only fault injection): stage 1 gives up
  after ``parallel.timeout_s`` with one line naming itself, stage 0 and the boundary.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from attnres_dist.checkpoint import store
from attnres_dist.cli import main
from attnres_dist.pipeline import watchdog
from tests.conftest import REPO, VENV_BIN
from tests.test_checkpoint import args_for, in_process


def test_non_finite_loss_stops_and_names_last_good_checkpoint(small_dataset, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = args_for(
        small_dataset,
        run_dir,
        **{
            "optim.lr": 1e30,
            "optim.min_lr": 0,
            "optim.grad_clip": 0,
            "checkpoint.every": 1,
        },
    )
    with in_process():
        assert main(["train", *args]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    step1 = run_dir / "checkpoints" / store.step_name(1)
    assert len(err) == 1 and re.fullmatch(
        rf"error: train: non-finite loss (nan|inf|-inf) at step 2; training stopped and nothing "
        rf"of this step was saved; the last good checkpoint is {re.escape(str(step1))} \(step 1\)",
        err[0],
    ), err
    assert [s for s, _ in store.step_dirs(run_dir / "checkpoints")] == [1]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert not (run_dir / "summary.json").exists()


@pytest.mark.slow
def test_stalled_neighbour_fails_naming_stage_and_boundary(small_dataset, tmp_path):
    # the rendezvous and step 1 must finish inside it: 45 s is ample for the ranks' start-up
    # skew with the 2 cores shared with other jobs (15 s was not)
    timeout = 45
    args = args_for(small_dataset, tmp_path / "run", pp=2, **{"parallel.timeout_s": timeout})
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        ATTNRES_FAULT="stall:before-step:0:2",
    )
    cmd = [str(VENV_BIN / "torchrun"), "--nproc-per-node=2", "--standalone", "-m"]
    cmd += ["attnres_dist.cli", "train", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    expected = (
        f"error: pipeline: stage 1 (rank 1) waited more than {timeout} s to receive activations "
        "from stage 0 at boundary 0->1 (after 2 of 4 layers); stage 0 is stalled or far slower "
        "(raise parallel.timeout_s if it is just slow)"
    )
    assert proc.returncode != 0
    assert expected in out.splitlines(), "\n".join(out.splitlines()[-30:])


def fake_engine(failure: str):
    """What ``watchdog.install`` needs from DeepSpeed's engine: a handler map and coordinates."""
    from deepspeed.runtime.pipe import schedule

    def fail(self, buffer_id):
        raise RuntimeError(failure)

    class Engine:
        stage_id, num_stages, global_rank = 0, 3, 4
        _INSTRUCTION_MAP = {
            schedule.RecvActivation: fail,
            schedule.SendActivation: fail,
            schedule.RecvGrad: fail,
            schedule.SendGrad: fail,
        }

    return Engine()


def test_lost_neighbour_is_named():
    from deepspeed.runtime.pipe import schedule

    engine = fake_engine("[pair.cc:553] Connection closed by peer [127.0.0.1]:5538. GLHF!")
    watchdog.install(engine, parts=[0, 3, 5, 7], num_layers=4, timeout_s=30)
    with pytest.raises(watchdog.StageWaitError) as info:
        engine._INSTRUCTION_MAP[schedule.RecvGrad](engine, buffer_id=0)
    assert str(info.value) == (
        "pipeline: stage 0 (rank 4) lost stage 1 while trying to receive gradients from it at "
        "boundary 0->1 (after 2 of 4 layers): the connection closed, so that rank crashed or "
        "was killed (see its log)"
    )
    # stage 0 has no previous stage: receiving activations is not a neighbour wait there
    with pytest.raises(RuntimeError) as plain:
        engine._INSTRUCTION_MAP[schedule.RecvActivation](engine, buffer_id=0)
    assert not isinstance(plain.value, watchdog.StageWaitError)
    # only this engine's map is wrapped, never DeepSpeed's class-level one
    assert type(engine)._INSTRUCTION_MAP[schedule.RecvGrad].__name__ == "fail"
