"""pytest plugin for the gates: a skip is a failure, and tests must run against wheels.

Load it with ``-p gefen_pytest_gates`` (``scripts/`` on ``PYTHONPATH``). Options:

``--gefen-fail-on-skip``
    Any skipped or xfailed test, and any module skipped at collection (``importorskip``),
    turns the run into a failure (exit status 1). The GPU sessions use it: on an accelerator
    machine, a GPU test that cannot run is a failure, not a skip.
``--gefen-require-installed``
    Fail unless every imported distribution package (``gefen``, ``gefen_kernels``,
    ``gefen_core``, ``gefen_dist``, ``gefen_bench``) was loaded from site-packages (not from a
    source tree): ``nox -s release_check`` runs the suites against the installed wheels.
``--gefen-summary PATH``
    Write ``{"passed", "failed", "skipped", "xfailed", "errors", "deselected",
    "skip_reasons"}`` as JSON to PATH (the release gate's summary reads it).

"No tests ran" is always a failure here: pytest's exit status 5 is kept, and callers
treat any non-zero status as failure.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest

_DISTRIBUTION_PACKAGES = frozenset(
    {"gefen", "gefen_kernels", "gefen_core", "gefen_dist", "gefen_bench"}
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gefen gates")
    group.addoption("--gefen-fail-on-skip", action="store_true", help="a skip is a failure")
    group.addoption(
        "--gefen-require-installed",
        action="store_true",
        help="fail unless gefen* modules come from site-packages",
    )
    group.addoption("--gefen-summary", metavar="PATH", help="write counts as JSON")


class _Gate:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0, "errors": 0}
        self.deselected = 0
        self.skip_reasons: list[str] = []
        self.problems: list[str] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.counts["skipped"] += 1
            self.skip_reasons.append(f"{report.nodeid}: {report.longrepr}")
        elif report.failed:
            self.counts["errors"] += 1

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if hasattr(report, "wasxfail"):
            if report.when == "call" or report.skipped:
                self.counts["xfailed"] += 1
                self.skip_reasons.append(f"{report.nodeid}: xfail {report.wasxfail}")
            return
        if report.skipped:
            self.counts["skipped"] += 1
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
            self.skip_reasons.append(f"{report.nodeid}: {reason}")
        elif report.failed:
            self.counts["failed" if report.when == "call" else "errors"] += 1
        elif report.when == "call":
            self.counts["passed"] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        opt = self.config.getoption
        if opt("gefen_fail_on_skip") and (self.counts["skipped"] or self.counts["xfailed"]):
            self.problems.append(
                f"{self.counts['skipped']} skipped and {self.counts['xfailed']} xfailed; "
                "under this gate a test that cannot run is a failure:"
            )
            self.problems.extend(f"  {r}" for r in self.skip_reasons)
        if opt("gefen_require_installed"):
            site = Path(sysconfig.get_paths()["purelib"]).resolve()
            for name, module in sorted(sys.modules.items()):
                # The distributions' import packages; this plugin (gefen_pytest_gates) and
                # test helpers are loaded from the checkout on purpose.
                if name not in _DISTRIBUTION_PACKAGES or module is None:
                    continue
                origin = getattr(module, "__file__", None)
                if origin is None or site not in Path(origin).resolve().parents:
                    self.problems.append(f"{name} was imported from {origin}, not {site}")
        if self.problems and session.exitstatus in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        summary = opt("gefen_summary")
        if summary:
            data = {**self.counts, "deselected": self.deselected, "skip_reasons": self.skip_reasons}
            data["exitstatus"] = int(session.exitstatus)
            Path(summary).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.problems:
            terminalreporter.section("gefen gate: FAILED", sep="=", red=True, bold=True)
            for line in self.problems:
                terminalreporter.line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Gate(config), "gefen-gate")
