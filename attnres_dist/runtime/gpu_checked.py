"""Which GPU fast paths a run of the GPU check (``make gpu-check``, docs/gpu.md) has run.

``auto`` takes a fast path on a GPU only where a GPU check has run it: an image that carries
Transformer Engine or apex (the NGC image) would otherwise train by default on code that has
never run here. Each entry is ``"field=value": (run, note)``; a path whose entry says not run
stays opt-in (asked for by name it is still taken where it imports), and the ``runtime:`` line
says so. After a GPU check has run a path (its CUDA tests and its training smoke pass), flip
its entry here and nothing else.
"""

from __future__ import annotations

NOT_RUN = "not yet run by the GPU check"

RUN_BY_GPU_CHECK: dict[str, tuple[bool, str]] = {
    # the GPU machine has neither TE nor apex (docs/gpu.md): never run
    "layer_spec=te": (False, "Transformer Engine is not on the GPU check's machine"),
    "fused_norm=apex": (False, "apex is not on the GPU check's machine"),
    "fused_optimizer=apex": (False, "apex is not on the GPU check's machine"),
    # tests/test_cuda_graphs.py and the speed step exist; no GPU check has run them yet
    "cuda_graphs=on": (False, "prepared, its CUDA test and speed step not yet run on a GPU"),
}


def has_run(path: str) -> bool:
    """Whether the GPU check has run ``path`` (``"field=value"``, a key of RUN_BY_GPU_CHECK)."""
    return RUN_BY_GPU_CHECK[path][0]


def not_run_reason(path: str, field: str, value: str) -> str:
    """The runtime line's reason when ``auto`` leaves ``path`` out."""
    return f"auto: {path} {NOT_RUN} ({RUN_BY_GPU_CHECK[path][1]}); runtime.{field}={value} takes it"
