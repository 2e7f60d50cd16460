"""Print the kvarn-vs-reference mismatch counts (collected by test_quantize.py) in the summary."""

import sys


def pytest_terminal_summary(terminalreporter):
    mod = sys.modules.get("tests.kvarn.test_quantize")
    report = getattr(mod, "REPORT", None)
    if report:
        terminalreporter.write_line(mod.format_report())
