"""Prints the worst relative error of each GPU test file after the run (``tolerance.WORST``)."""

from tolerance import WORST


def pytest_terminal_summary(terminalreporter):
    if WORST:
        terminalreporter.section("worst relative errors (tests/gpu/tolerance.py)")
        for source, (err, what) in sorted(WORST.items()):
            terminalreporter.write_line(f"{source}: {err:.3e} ({what})")
