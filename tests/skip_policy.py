"""The suite's skip policy, as a pytest plugin (tests/conftest.py loads it): under CI (the
``CI`` environment variable set, as ``.ci/run`` does) a run in which any test is skipped for a
reason other than the allowed ones fails, so a reference check that quietly stopped running
(an oracle library missing from the extras, an asset that did not install) is a red build, not
a line in the summary. The one allowed reason: a test that needs a CUDA device on a CPU
machine."""

from __future__ import annotations

import os

import pytest

ALLOWED_SKIP_REASONS = ("needs a CUDA device",)


def _unallowed(terminalreporter) -> list[str]:
    out = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if not any(allowed in reason for allowed in ALLOWED_SKIP_REASONS):
            out.append(f"{report.nodeid}: {reason}")
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not os.environ.get("CI"):
        return
    bad = _unallowed(terminalreporter)
    if bad:
        terminalreporter.section("skips not allowed under CI", sep="=", red=True)
        for line in bad:
            terminalreporter.line(line)
        terminalreporter.line(f"only {ALLOWED_SKIP_REASONS} may skip (tests/skip_policy.py)")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if not os.environ.get("CI") or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and _unallowed(reporter):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
