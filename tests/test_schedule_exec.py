"""Message ordering on real gloo p2p: the virtual schedules' streams, executed with fake work.

``pipeline/schedule_exec.py`` runs each rank's instructions with real ``batch_isend_irecv``
at every ``CommitP2P`` (DeepSpeed's ``DualPipeVSchedule``, the interleaved schedule) or real
blocking p2p (``TrainSchedule``), with messages whose shape is their hand-over's and whose
contents name (kind, chunk, micro-batch, sender). At P = 2 activations and gradients to the
same peer share commits; every receive must get exactly its message, with no deadlock (the
process group times out after 60 s). The first-in-first-out pairing is gloo's, not modelled.
"""

from __future__ import annotations

import json

import pytest

from attnres_dist.pipeline.schedule_exec import build_schedule
from attnres_dist.pipeline.schedule_sim import simulate
from tests.conftest import run_job

WORKER = "tests/workers/schedule_exec_case.py"


def messages(name: str, P: int, V: int, M: int) -> int:
    """Activations plus gradients over all hand-overs; DualPipeV's turn stays on its rank."""
    if name == "1f1b":
        return 2 * (P - 1) * M
    if name == "dualpipev":
        return 2 * (2 * P - 2) * M
    return 2 * (P * V - 1) * M


def check_case(entry: dict, P: int) -> None:
    name, V, M = entry["case"].split(":")[:3]
    V, M = int(V), int(M)
    ranks = entry["ranks"]
    assert [r["rank"] for r in ranks] == list(range(P))
    assert sum(r["received"] for r in ranks) == sum(r["sent"] for r in ranks)
    assert sum(r["received"] for r in ranks) == messages(name, P, V, M), entry["case"]
    # the passes ran in the order the stream prescribes, as the process-free simulator runs it
    built = [build_schedule(name, P, r, M, V) for r in range(P)]
    sim = simulate([b[0] for b in built], built[0][1], built[0][2], M, phased=built[0][3])
    for r in ranks:
        order = [(p["forward"], p["chunk"], p["micro_batch"]) for p in r["passes"]]
        assert order == list(sim.orders[r["rank"]]), (entry["case"], r["rank"])
    assert 0.0 <= entry["bubble"] < 1.0


@pytest.mark.slow
def test_two_ranks_every_receive_gets_its_message(tmp_path):
    out = tmp_path / "exec.json"
    cases = [
        "interleaved:2:4:0:0",
        "interleaved:3:4:1:2",
        "interleaved:2:6:2:1",  # backward cheaper than planned: commits wait, order holds
        "dualpipev:2:4:1:2",
        "dualpipev:2:6:0:0",
        "1f1b:1:4:0:0",
    ]
    run_job([WORKER, str(out), *cases], nproc=2, timeout=300)
    report = json.loads(out.read_text())
    assert [e["case"] for e in report] == cases
    for entry in report:
        check_case(entry, 2)


@pytest.mark.slow
def test_four_ranks_every_receive_gets_its_message(tmp_path):
    out = tmp_path / "exec4.json"
    cases = ["interleaved:2:4:0:0", "dualpipev:2:8:0:0"]
    run_job([WORKER, str(out), *cases], nproc=4, timeout=300)
    for entry in json.loads(out.read_text()):
        check_case(entry, 4)


@pytest.mark.slow
def test_a_swapped_pair_of_messages_is_caught(tmp_path):
    # same shape everywhere, so only the contents can tell the swapped messages apart
    with pytest.raises(AssertionError, match="MessageOrderError: rank 1: .* expected message"):
        run_job([WORKER, str(tmp_path / "x.json"), "interleaved:2:4:0:0:swap:uniform"], nproc=2)
