"""Runs recorded on the wire, and the cache plan's prediction of what they send.

``recorded_cases`` trains configurations in one launch under torchrun with
``workers/train_cases.py --wire``, which records every tensor a virtual-stage engine queues for
a p2p operation. ``check_wire`` compares each rank's training record with the ``CachePlan``:
each transition's activation from its sender and its gradient (of the same shape) back from its
receiver, once per micro-batch and step, one packed tensor each, nothing else; evaluation sends
activations only. It returns the bytes sent, which then equal the plan's
``bytes_per_micro_batch`` x 2 (activation + gradient) x M x steps.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from attnres_dist.config import load_config
from attnres_dist.pipeline import virtual_setup
from tests.equivalence_helpers import train_cases


def recorded_cases(tmp_path: Path, cases: dict[str, list[str]], nproc: int) -> dict:
    """name -> (rank 0's result as ``train_cases``'s, every rank's p2p record), or the string
    saying why the case has none."""
    results = train_cases(tmp_path, cases, nproc, wire=True)

    def records(name: str) -> list[dict]:
        return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(nproc)]

    return {
        name: result if isinstance(result, str) else (result, records(name))
        for name, result in results.items()
    }


def _plan(cfg):
    return virtual_setup.cache_plan(cfg, virtual_setup.layout_of(cfg, 0))  # uniform: no vocab


def expected_ops(cfg, stage: int, cached: bool) -> tuple[Counter, set]:
    """Training: (op, peer, shape) -> count on one pipeline rank over the run; evaluation: the
    activation (op, peer, shape)s."""
    M = cfg.train.global_batch_size // cfg.train.micro_batch_size // cfg.parallel.dp
    n = M * cfg.train.steps
    train, forward = Counter(), set()
    for t in _plan(cfg).transitions:
        if t.kind == "local":
            continue
        shape = tuple(t.shape(cached))
        if t.src_rank == stage:  # activation out, its gradient back in
            train[("isend", t.dst_rank, shape)] += n
            train[("irecv", t.dst_rank, shape)] += n
            forward.add(("isend", t.dst_rank, shape))
        if t.dst_rank == stage:
            train[("irecv", t.src_rank, shape)] += n
            train[("isend", t.src_rank, shape)] += n
            forward.add(("irecv", t.src_rank, shape))
    return train, forward


def _ops(ops) -> list[tuple]:
    assert all(len(shapes) == 1 for _, _, shapes, _ in ops)  # one packed tensor per payload
    return [(op, peer, tuple(shapes[0]), itemsize) for op, peer, shapes, itemsize in ops]


def check_wire(args: list[str], records: list[dict]) -> int:
    """Assert every rank sent and received the plan's payloads; the bytes sent by all ranks."""
    cfg = load_config(None, args)
    cached = cfg.parallel.cross_stage_cache
    sent = 0
    for record in records:
        train, forward = expected_ops(cfg, record["stage"], cached)
        got = _ops(record["train"])
        assert Counter(op[:3] for op in got) == train, (record["rank"], cached)
        assert {op[:3] for op in _ops(record["eval"])} == forward, (record["rank"], cached)
        sent += sum(n * torch.Size(shape).numel() for op, _, shape, n in got if op == "isend")
    M = cfg.train.global_batch_size // cfg.train.micro_batch_size
    predicted = _plan(cfg).bytes_per_micro_batch(cached) * 2 * M * cfg.train.steps
    assert sent == predicted * cfg.parallel.tp  # unpartitioned: every tensor rank sends it all
    return sent


def plan_bytes(args: list[str]) -> tuple[int, int]:
    """(cached, naive) activation bytes per micro-batch the plan predicts for a config."""
    plan = _plan(load_config(None, args))
    return plan.bytes_per_micro_batch(True), plan.bytes_per_micro_batch(False)
