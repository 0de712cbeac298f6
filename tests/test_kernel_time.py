"""The harness's kernel clock (``bench/kernel_time.py``): it times the C kernels called inside
it, from outside the package, and leaves the package as it found it."""

from __future__ import annotations

import pytest
import torch

from attnres_dist.ops import cpu_library, cpu_rms_norm
from attnres_dist.ops.cpu_rms_norm import requirement, rms_norm
from bench.kernel_time import kernel_clock

pytestmark = pytest.mark.skipif(requirement() is not None, reason=f"no C kernels: {requirement()}")


def definition(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_kernel_clock_counts_the_calls_made_inside_it():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.ones(32, requires_grad=True)
    rms_norm(x, w).sum().backward()  # before the clock: not counted
    with kernel_clock() as clock:
        y = rms_norm(x.detach(), w.detach())
    rms_norm(x, w).sum().backward()  # after it: not counted either
    assert set(clock) == {"rms_norm_fwd"} and clock["rms_norm_fwd"] > 0
    torch.testing.assert_close(y, definition(x.detach(), w.detach(), 1e-5))
    with kernel_clock() as clock:
        rms_norm(x, w).sum().backward()
    assert set(clock) == {"rms_norm_fwd", "rms_norm_bwd"}


def test_kernel_clock_puts_the_entry_point_back():
    call = cpu_library.call
    with kernel_clock():
        assert cpu_rms_norm.call is not call and cpu_library.call is not call  # timed inside
    assert cpu_rms_norm.call is call and cpu_library.call is call
    with pytest.raises(RuntimeError), kernel_clock():
        raise RuntimeError("a failing step")
    assert cpu_rms_norm.call is call and cpu_library.call is call
