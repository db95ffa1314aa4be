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
    t = tool.split(json.loads(tool.RECORD.read_text()), marks)
    assert t["n_heavy"] and not t["heavy_not_slow"], f"heavy but not slow (README command 2 would run them): {t['heavy_not_slow']}"
    assert not t["unmeasured"], f"slow tests with no measured duration (python benchmarks/slow_durations.py LOG --write): {t['unmeasured']}"
    assert t["ci"] <= tool.CI_SLOW_BUDGET_S, (f"`.ci/run`'s slow part is {t['ci']:.0f} s, over its "
                                             f"{tool.CI_SLOW_BUDGET_S} s: mark the longest heavy", t["ci"])
    ci = (REPO / ".ci" / "run").read_text()
    assert '-m "slow and not heavy"' in ci and "-m slow " not in ci, ".ci/run must leave the heavy tests out"


def test_split_keeps_to_the_tests_collected_today():
    """A recorded test that no longer exists counts nowhere; an unrecorded slow one is named."""
    record = {"seconds": {"t::gone": 500.0, "t::a": 10.0, "t::h": 100.0}}
    t = _tool().split(record, {"t::a": {"slow"}, "t::h": {"slow", "heavy"}, "t::new": {"slow"}})
    assert (t["all"], t["ci"], t["heavy"], t["n_ci"], t["n_heavy"]) == (110.0, 10.0, 100.0, 1, 1)
    assert t["unmeasured"] == ["t::new"]


def test_performance_page_quotes_the_recorded_split(marks):
    """docs/performance.md's heavy / CI split is the record's, as benchmarks/slow_durations.py prints it."""
    tool = _tool()
    t = tool.split(json.loads(tool.RECORD.read_text()), marks)
    text = " ".join((REPO / "docs" / "performance.md").read_text().split())
    assert f"(`-m heavy`, {t['n_heavy']} tests, {t['heavy']:.0f} s" in text, t
    assert f"(`-m \"slow and not heavy\"`, {t['n_ci']} tests, {t['ci']:.0f} s" in text, t
