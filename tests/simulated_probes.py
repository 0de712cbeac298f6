"""What each probe of ``attnres_dist.runtime.probes`` reports on a simulated machine that has
the component (``OK``) or lacks it (``MISSING``): the tables behind the ``machine`` fixture
(``tests/conftest.py``)."""

from __future__ import annotations

from attnres_dist.runtime import probes

OK = {
    "cuda": probes.Probe(True, "NVIDIA H100 80GB HBM3"),
    "bf16": probes.Probe(True, "GPU compute capability 9.0"),
    "transformer_engine": probes.Probe(True, "transformer_engine 2.10.0"),
    "apex_norm": probes.Probe(True, "apex FusedRMSNorm"),
    "apex_adam": probes.Probe(True, "apex FusedAdam"),
    "cpu_kernels": probes.Probe(True, "the project's fused C RMSNorm"),
    "glibc_malloc": probes.Probe(True, "glibc 2.36"),
}
MISSING = {
    "cuda": probes.Probe(False, "no CUDA device visible"),
    "bf16": probes.Probe(False, "GPU compute capability 7.0 has no bf16 support"),
    "transformer_engine": probes.Probe(
        False, "transformer_engine not importable (No module named 'transformer_engine')"
    ),
    "apex_norm": probes.Probe(False, "apex FusedRMSNorm not importable (No module named 'apex')"),
    "apex_adam": probes.Probe(False, "apex FusedAdam not importable (No module named 'apex')"),
    "cpu_kernels": probes.Probe(False, "the C kernels cannot be built here (no C compiler)"),
    "glibc_malloc": probes.Probe(False, "the C library is not glibc (no gnu_get_libc_version)"),
}
