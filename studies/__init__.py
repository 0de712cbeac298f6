"""The study drivers, run from the repository root: ``python -m studies.study`` (``make study``:
baseline vs Block vs Full AttnRes, several seeds and learning rates, ``lr_sweep`` giving each
variant its best rate) and ``python -m studies.overhead`` (what the instrumentation costs).

Part of the measurement harness beside the ``attnres_dist`` package: they train through the
package (``attnres-dist train``, the trainer, ``attnres_dist.diagnostics``' report), which never
imports them; the wheel does not ship them (``pyproject.toml``).
"""
