"""A pytest plugin for scripts/gpu_check.sh (`-p pytest_live_report`, with scripts/ on PYTHONPATH): each test's start,
its outcome and duration, and a failure's traceback, written to the log the moment they happen, so a run cut short
by its time limit still shows every result it reached and the test it was in. Under pytest-xdist the controller
writes them: its workers' stderr goes to the same log."""
import os
import sys
import time

IN_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def pytest_runtest_logstart(nodeid: str, location) -> None:
    if IN_WORKER:
        return
    print(f"[{time.strftime('%H:%M:%S')}] STARTED {nodeid}", file=sys.stderr, flush=True)


def pytest_runtest_logreport(report) -> None:
    if IN_WORKER:
        return
    if report.when == "call" or report.outcome != "passed":  # setup/teardown only when they fail (or skip)
        line = f"[{time.strftime('%H:%M:%S')}] {report.outcome.upper()} {report.nodeid} ({report.duration:.1f} s)"
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            line += f": {report.longrepr[2]}"
        print(line, file=sys.stderr, flush=True)
        if report.outcome == "failed":
            print(report.longreprtext[-6000:], file=sys.stderr, flush=True)
