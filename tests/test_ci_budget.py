"""CI's time: every slow test has a measured duration (benchmarks/results/slow_durations.json, made by
benchmarks/slow_durations.py from a `pytest -v -m slow --durations=0` run), the part `.ci/run` runs
(-m "slow and not heavy") fits its budget, and a heavy test is a slow one (README command 2 never
runs it). A new slow test that is not measured, or one that pushes CI's part over the budget, fails
here: measure it, and mark it heavy if it takes minutes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool():
    from benchmarks import slow_durations  # the repository root is on sys.path: tests/ is a package

    return slow_durations


@pytest.fixture(scope="module")
def marks() -> dict[str, set[str]]:
    """One collection of the slow / heavy tests (about 15 s) for the module."""
    return _tool().collected()


def test_parse_sums_the_phases_and_keeps_tests_under_the_display_floor():
    log = "\n".join([
        "1795896478 tests/test_a.py::test_x PASSED [ 50%]",
        "1795896479 tests/test_a.py::test_y[p 1] PASSED [100%]",
        "1795896480 12.50s call     tests/test_a.py::test_x",
        "1795896480 2.25s setup    tests/test_a.py::test_x",
        "0.01s teardown tests/test_a.py::test_x",
    ])
    assert _tool().parse(log) == {"tests/test_a.py::test_x": 14.76, "tests/test_a.py::test_y[p 1]": 0.0}


def test_every_slow_test_is_measured_and_ci_fits_its_budget(marks):
    tool = _tool()
    slow = {k for k, m in marks.items() if "slow" in m}
    heavy = {k for k, m in marks.items() if "heavy" in m}
    assert heavy and heavy <= slow, f"heavy but not slow (README command 2 would run them): {sorted(heavy - slow)}"
    record = json.loads(tool.RECORD.read_text())
    missing = sorted(slow - set(record["seconds"]))
    assert not missing, f"slow tests with no measured duration (python benchmarks/slow_durations.py LOG --write): {missing}"
    t = tool.totals({"seconds": {k: v for k, v in record["seconds"].items() if k in slow}}, heavy)
    assert t["ci"] <= tool.CI_SLOW_BUDGET_S, (f"`.ci/run`'s slow part is {t['ci']:.0f} s, over its "
                                             f"{tool.CI_SLOW_BUDGET_S} s: mark the longest heavy", t)
    ci = (REPO / ".ci" / "run").read_text()
    assert '-m "slow and not heavy"' in ci and "-m slow " not in ci, ".ci/run must leave the heavy tests out"


def test_performance_page_quotes_the_recorded_split(marks):
    """docs/performance.md's heavy / CI split is the record's, as benchmarks/slow_durations.py prints it."""
    tool = _tool()
    heavy = {k for k, m in marks.items() if "heavy" in m}
    record = json.loads(tool.RECORD.read_text())
    t = tool.totals(record, heavy)
    text = " ".join((REPO / "docs" / "performance.md").read_text().split())
    assert f"(`-m heavy`, {len(heavy)} tests, {t['heavy']:.0f} s" in text, t
    assert f"(`-m \"slow and not heavy\"`, {len(set(record['seconds']) - heavy)} tests, {t['ci']:.0f} s" in text, t
