"""Seconds spent inside the project's C kernels, timed from outside the package.

The CPU kernels (``attnres_dist/ops/csrc``) are entered through one function,
``attnres_dist.ops.cpu_library.call``, which each kernel module imports under its own name
``call``. ``kernel_clock`` swaps that name, in every loaded module of the package that holds it,
for a wrapper that adds each call's wall time to a dict, and swaps it back on exit: the product
carries no timing hook, and a step outside the clock pays nothing. Modules first imported inside
the block are not timed (build the model before entering it); clocks do not nest.
"""

from __future__ import annotations

import contextlib
import sys
import time


@contextlib.contextmanager
def kernel_clock():
    """Seconds spent inside each kernel entry point (a dict filled while the block runs)."""
    from attnres_dist.ops import cpu_library

    call = cpu_library.call
    clock: dict[str, float] = {}

    def timed(name: str, *args) -> None:
        start = time.perf_counter()
        call(name, *args)
        clock[name] = clock.get(name, 0.0) + time.perf_counter() - start

    holders = [
        module
        for key, module in list(sys.modules.items())
        if key.startswith("attnres_dist.") and getattr(module, "call", None) is call
    ]
    for module in holders:
        module.call = timed
    try:
        yield clock
    finally:
        for module in holders:
            module.call = call
