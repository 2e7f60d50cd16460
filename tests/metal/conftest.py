"""Print the commit kernel's mismatch counts (collected by test_commit.py) in the pytest summary."""

import sys


def pytest_terminal_summary(terminalreporter):
    mod = sys.modules.get("tests.metal.test_commit")
    report = getattr(mod, "REPORT", None)
    if report:
        terminalreporter.write_line(mod.format_report())
