"""A pytest plugin for GPU runs cut by a time limit: every test's outcome as it happens, not at the session's end.

Load with ``-p pytest_live_report`` (``benchmarks/`` on ``PYTHONPATH``). For every test it appends one JSON line to
the file named by ``$PYTEST_LIVE_REPORT`` (flushed at once): ``{"nodeid", "when", "outcome", "duration",
"message", "xfail"}``; ``when`` is ``setup`` / ``call`` / ``teardown`` (a phase's line is written when the phase
failed or skipped, or for ``call`` always), ``message`` the failure's one-line crash message (what ``-rf`` prints)
or the skip reason. A failure's message is also printed to the terminal at once (``LIVE FAIL <nodeid>: <message>``)
instead of only in the end-of-session summary, which a killed pytest never prints.

``benchmarks/gpu_quick.py tests-report`` reads these lines for a test file whose pytest did not live to write its
JUnit XML. Without ``$PYTEST_LIVE_REPORT`` the plugin does nothing.
"""

from __future__ import annotations

import json
import os

_config = None


def pytest_configure(config):
    """Keep the config (its terminal writer prints the live failure lines)."""
    global _config
    _config = config


def _message(report) -> str:
    """The one-line reason of a failed or skipped report (crash message, or the skip reason)."""
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    text = getattr(report, "longreprtext", "") or ""
    return text.strip().splitlines()[-1] if text.strip() else ""


def pytest_runtest_logreport(report):
    """Append this phase's outcome to ``$PYTEST_LIVE_REPORT``; print a failure's message at once."""
    path = os.environ.get("PYTEST_LIVE_REPORT")
    if not path or (report.when != "call" and report.passed):
        return
    rec = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "duration": round(float(report.duration), 3), "message": "" if report.passed else _message(report)[:2000],
           "xfail": hasattr(report, "wasxfail")}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
    if report.failed and _config is not None:
        _config.get_terminal_writer().line(f"LIVE FAIL {report.nodeid} ({report.when}): {rec['message']}")
