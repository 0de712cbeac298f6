"""Diagnostics: per-layer instrumentation of training runs, their report, and the study.

* ``probe`` / ``grads`` / ``collector``: ``metrics.every_k`` instrumentation (activation RMS,
  depth-attention weights, gradient norms), gathered over pipeline stages into
  ``RUN_DIR/diagnostics.jsonl``;
* ``runs`` / ``plots`` / ``report``: reading run directories back and rendering PNG plots and
  a markdown summary (``attnres-dist report``);
* ``study``: the baseline vs Block vs Full AttnRes study behind ``make study``.
"""
