"""The fault suite's tally (``tests/conftest.py:fault_class``): how each probe's report is
classed in the one line printed after a run."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

# tests/conftest.py by its path: under tests/faults/ the name ``conftest`` is this folder's own.
_spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def _report(passed=False, skipped=False, message="", text="", xfail=False):
    longrepr = type("Repr", (), {"reprcrash": SimpleNamespace(message=message), "__str__": lambda self: text})()
    report = SimpleNamespace(passed=passed, skipped=skipped, longrepr=longrepr)
    if xfail:
        report.wasxfail = "known"
    return report


def test_each_ending_has_its_class():
    assert conftest.fault_class(_report(passed=True)) == "clean"
    assert conftest.fault_class(_report(skipped=True)) == "unclear"
    assert conftest.fault_class(_report(xfail=True, message="AssertionError")) == "unclear"
    assert conftest.fault_class(_report(message="Failed: Timeout >30s", text="Timeout")) == "hang"
    assert conftest.fault_class(_report(message="subprocess.TimeoutExpired", text="timed out after 30")) == "hang"
    assert conftest.fault_class(_report(message="AssertionError: the archive lost COMPLETE")) == "wrong"
    assert conftest.fault_class(_report(message="NotADirectoryError: step_00000004")) == "crash"
