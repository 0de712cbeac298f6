"""The batch prefetcher (``data/prefetch.py``): the same batches in the same order, the next
one built in another thread before it is asked for, errors raised at the step they belong to."""

from __future__ import annotations

import threading

import pytest
import torch

from attnres_dist.data.prefetch import Prefetcher


def test_same_batches_in_order_each_built_once_ahead_in_another_thread():
    built, threads = [], set()
    ready = {s: threading.Event() for s in range(3, 8)}

    def batches(step):
        built.append(step)
        threads.add(threading.get_ident())
        ready[step].set()
        return [torch.full((2, 5), step)]

    prefetch = Prefetcher(batches, 3, 8)
    try:
        for step in range(3, 8):
            got = prefetch.get(step)
            assert len(got) == 1 and torch.equal(got[0], torch.full((2, 5), step))
            if step + 1 < 8:  # the next step is built without being asked for
                assert ready[step + 1].wait(timeout=60)
    finally:
        prefetch.close()
    assert built == [3, 4, 5, 6, 7]  # nothing past the last step, nothing twice
    assert threading.get_ident() not in threads


def test_an_error_is_raised_at_its_own_step_and_a_jump_is_served():
    def batches(step):
        if step == 2:
            raise ValueError("step 2 is outside the samples built")
        return [torch.tensor([step])]

    prefetch = Prefetcher(batches, 0, 5)
    try:
        assert prefetch.get(0)[0].item() == 0
        assert prefetch.get(1)[0].item() == 1
        with pytest.raises(ValueError, match="step 2"):
            prefetch.get(2)
        assert prefetch.get(4)[0].item() == 4  # not the step built ahead: built on demand
    finally:
        prefetch.close()
