"""A pytest plugin for the GPU check: a failing test's traceback printed as it fails.

pytest prints tracebacks in its closing summary; a step stopped at its time limit never
reaches that summary, so without this plugin its log names a failure but not its cause.
"""

from __future__ import annotations


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n--- {report.nodeid} ({report.when}) ---\n{report.longreprtext[-4000:]}\n---")
