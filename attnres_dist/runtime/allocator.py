"""The host allocator's policy for freed memory (``runtime.cpu_allocator``).

torch's CPU tensors come from the C library's ``malloc``. glibc serves a request above its mmap
threshold (128 KiB at first, raised as blocks are freed, at most 32 MiB) with a fresh ``mmap``
and gives it back to the kernel on ``free``, and it trims the heap top past 128 KiB of free
space: the next step's tensor of that size is new memory again, and every 4 KiB page of it is a
page fault on first touch (zeroed by the kernel). A training step allocates the same sizes
every step, so on a CPU this is pure overhead: measured here, 4,800-6,600 faults and 9-28 ms of
system time per step of the baseline models, and 18,500 faults and 64 ms per step of the
32 x 64 Full AttnRes model, whose block store and its gradient buffer (33 MB each) are above
any threshold.

``retain`` keeps freed memory in the process: ``mmap`` is not used for allocations
(``M_MMAP_MAX = 0``), the heap is not trimmed below 2 GiB of free space at its top
(``M_TRIM_THRESHOLD``) and it grows 64 MiB at a time (``M_TOP_PAD``). After the first steps
a step touches almost no new page (the steps above: 2-1,000 faults). The cost is that the
process's resident size stays at its high-water mark, which a trainer reaches every step
anyway. This is what the tcmalloc / jemalloc preload commonly advised for torch on CPU does;
here it needs no extra library and no launcher change. It applies to the whole process from
the call on, and is not undone.

Not guaranteed for every size: torch allocates with 64-byte alignment (``posix_memalign``,
which asks glibc for a little more than the size). Where a small allocation was carved from
the heap top right after a large tensor, that tensor's freed chunk cannot merge back into the
top and is a few bytes short of the next request of its size, which then takes fresh pages
(seen for a lone 64 MiB tensor in some fresh processes, ``tests/test_allocator.py``).
"""

from __future__ import annotations

import ctypes
import functools

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB of free heap top before a trim
TOP_PAD = 64 << 20


@functools.lru_cache(maxsize=1)
def glibc() -> tuple[ctypes.CDLL | None, str]:
    """This process's C library when it is glibc (with its version), else None and why."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None, "the C library is not glibc (no gnu_get_libc_version)"
    version.restype = ctypes.c_char_p
    return libc, f"glibc {version().decode()}"


def retain_freed_memory() -> None:
    """Keep freed memory in this process for reuse (the ``retain`` policy, see above)."""
    libc, detail = glibc()
    if libc is None:
        raise RuntimeError(detail)
    for param, value in (
        (M_MMAP_MAX, 0),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD),
    ):
        if libc.mallopt(param, value) != 1:  # mallopt returns 1 on success
            raise RuntimeError(f"mallopt({param}, {value}) failed ({detail})")
