"""The benchmarks behind ``make bench`` (``python -m bench.run``), run from the repository root.

Part of the measurement harness beside the ``attnres_dist`` package: it imports the package and
the wheel does not ship it (``pyproject.toml``); ``tests/test_layering.py`` holds that the
package never imports it.
"""
