"""The cross-stage cache on the wire: what the virtual-stage engines really send (2 ranks, gloo).

Each schedule trains 3 steps at P = 2 with the cache on and off; both runs must match the
single-process reference (``test_virtual_equivalence``'s check: losses, validation loss and
every parameter, fp32, TOL), and

every tensor the engine queues for a p2p operation is recorded (``workers/wire_case.py``); per
rank and peer, the payload shapes of a training step must be the plan's (``CachePlan``): each
transition's activation from its sender and its gradient, of the same shape, back from its
receiver, once per micro-batch, nothing else. Cached payloads are the blocks the receiver lacks
plus the partial block, so the cached run moves fewer bytes than the naive one. Block size 3
over one-layer chunks puts block boundaries inside chunks, so partial blocks cross.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from attnres_dist.config import load_config
from attnres_dist.pipeline import virtual_setup
from tests.conftest import run_job
from tests.test_pipeline_equivalence import TOL, assert_matches, overrides, train_case

SCHEDULES = {
    "dualpipev": {"parallel.schedule": "dualpipev"},
    "interleaved": {"parallel.schedule": "interleaved", "parallel.virtual_stages": 2},
}


def expected_ops(cfg, rank: int, cached: bool) -> tuple[Counter, set]:
    """Training: (op, peer, shape) -> count for one rank over the run; eval: activation
    (op, peer, shape)s only. From the cache plan (the uniform partition needs no vocabulary)."""
    plan = virtual_setup.cache_plan(cfg, virtual_setup.layout_of(cfg, 0))
    M = cfg.train.global_batch_size // cfg.train.micro_batch_size // cfg.parallel.dp
    train, forward = Counter(), set()
    for t in plan.transitions:
        if t.kind == "local":
            continue
        shape = tuple(t.shape(cached))
        if t.src_rank == rank:  # activation out, its gradient back in
            train[("isend", t.dst_rank, shape)] += M * cfg.train.steps
            train[("irecv", t.dst_rank, shape)] += M * cfg.train.steps
            forward.add(("isend", t.dst_rank, shape))
        if t.dst_rank == rank:
            train[("irecv", t.src_rank, shape)] += M * cfg.train.steps
            train[("isend", t.src_rank, shape)] += M * cfg.train.steps
            forward.add(("irecv", t.src_rank, shape))
    return train, forward


def ops_of(ops) -> list[tuple]:
    assert all(len(shapes) == 1 for _, _, shapes, _ in ops)  # one packed tensor per payload
    return [(op, peer, tuple(shapes[0]), itemsize) for op, peer, shapes, itemsize in ops]


@pytest.fixture(scope="module")
def reference(small_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    return train_case(tmp, "block", overrides(small_dataset, "block", str(tmp / "r")), 1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_cache_on_and_off_match_reference_and_send_the_plans_bytes(
    schedule, reference, small_dataset, tmp_path
):
    sent = {}
    for cached in (True, False):
        extra = {**SCHEDULES[schedule], "parallel.cross_stage_cache": str(cached).lower()}
        args = overrides(small_dataset, "block", str(tmp_path / f"r{cached}"), pp=2, **extra)
        cfg = load_config(None, args)
        out = tmp_path / f"wire{cached}"
        run_job(["tests/workers/wire_case.py", str(out), *args], nproc=2)
        result = torch.load(out / "result.pt")
        assert_matches(result, reference, f"{schedule} block pp=2 cache={cached}")
        assert abs(result["valid"] - reference["valid"]) <= TOL * (1 + abs(reference["valid"]))
        sent[cached] = 0
        for rank in range(2):
            record = json.loads((out / f"rank{rank}.json").read_text())
            train, forward = expected_ops(cfg, rank, cached)
            got = ops_of(record["train"])
            assert Counter(op[:3] for op in got) == train, (rank, cached)
            assert {op[:3] for op in ops_of(record["eval"])} == forward, (rank, cached)
            sent[cached] += sum(n * _numel(shape) for op, _, shape, n in got if op == "isend")
    steps = cfg.train.steps
    print(f"{schedule}: bytes sent in {steps} steps, cached {sent[True]:,} naive {sent[False]:,}")
    assert sent[True] < sent[False]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
