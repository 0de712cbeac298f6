"""Diagnostics: per-layer instrumentation of training runs and their report.

* ``probe`` / ``grads`` / ``collector``: ``metrics.every_k`` instrumentation (activation RMS,
  depth-attention weights, gradient norms), gathered over pipeline stages into
  ``RUN_DIR/diagnostics.jsonl``;
* ``runs`` / ``plots`` / ``report``: reading run directories back and rendering PNG plots and
  a markdown summary (``attnres-dist report``).

The study behind ``make study`` that reads them is ``studies/study.py``, outside the package.
"""
