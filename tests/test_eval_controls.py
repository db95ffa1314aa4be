"""The controls' test (train/eval/controls.py): exact one-sided binomial on the effective n, Holm over a
table's control rows, the frozen term for a job whose score includes one."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from train.eval import controls as ct
from train.eval.intervals import wilson, wilson_n


def _row(k, n, chance, **kw):
    lo, hi = wilson(k, n)
    return {"value": 100.0 * k / n, "chance": 100.0 * chance, "ci_low": lo, "ci_high": hi, "unit": "%", **kw}


@pytest.mark.parametrize("p,n", [(0.3, 40), (3 / 560, 560), (0.0, 52), (1.0, 20), (0.62, 1491.7)])
def test_effective_n_is_the_n_of_the_wilson_interval(p, n):
    lo, hi = wilson_n(p, n, 1.0)
    assert ct.effective_n(p, lo, hi) == pytest.approx(n, rel=1e-6)


def test_the_wilson_false_pass_at_3_hits_of_560_is_not_a_pass_here():
    """Chance 1/560 on 560 items: Wilson's lower bound clears chance at 3 hits (P(X >= 3) = 8% under the null,
    nominal 2.5%); the exact test does not call 3 hits above chance, and its own false-pass rate is at most 2.5%."""
    n, c = 560, 1 / 560
    assert wilson(3, n, 1.0)[0] > c  # Wilson: "above chance"
    assert binom.sf(2, n, c) == pytest.approx(0.0803, abs=5e-4)  # how often 3+ hits happen at chance
    p3 = ct.above_chance_p(_row(3, n, c))
    assert p3 == pytest.approx(binom.sf(2, n, c), rel=1e-6) and not ct.holm([p3])[0]
    # the false-pass rate of each rule under the null, summed over every hit count
    ks = np.arange(0, 30)
    exact = sum(binom.pmf(k, n, c) for k in ks if ct.holm([ct.above_chance_p(_row(k, n, c))])[0])
    wil = sum(binom.pmf(k, n, c) for k in ks if wilson(k, n, 1.0)[0] > c)
    assert exact <= 0.025 < wil and wil == pytest.approx(0.0803, abs=5e-4)


def test_the_exact_p_value_is_the_binomial_tail_on_whole_items():
    for k, n, c in [(30, 50, 0.5), (7, 20, 0.25), (0, 10, 0.1), (12, 12, 0.5)]:
        assert ct.above_chance_p(_row(k, n, c)) == pytest.approx(binom.sf(k - 1, n, c) if k else 1.0, rel=1e-6)


def test_holm_against_a_hand_computed_step_down():
    # sorted 0.001 (vs 0.025/4), 0.006 (vs 0.025/3), 0.0125 (vs 0.025/2 = 0.0125: rejected), 0.04 (vs 0.025: kept)
    assert ct.holm([0.04, 0.006, None, 0.001, 0.0125]) == [False, True, False, True, True]
    assert ct.holm([0.009, 0.009, 0.009]) == [False, False, False]  # each above 0.025/3
    assert ct.holm([]) == []


def test_a_control_of_a_job_whose_score_includes_a_frozen_term_is_tested_against_it():
    ctl = {**_row(300, 500, 0.5), "diff_vs": "acc[frozen]", "diff": 0.4, "diff_low": -1.6, "diff_high": 2.4}
    t = ct.control_test(ctl, includes_frozen=True)
    assert t.against == "acc[frozen]" and 0.3 < t.p < 0.4  # z = 0.4 / (4 / 3.92): p = 0.35
    assert ct.control_test(ctl).against == "chance" and ct.control_test(ctl).p < 1e-4
    up = {**ctl, "diff": 4.0, "diff_low": 2.0, "diff_high": 6.0}
    tests = [ct.control_test(up, True), t, None]
    ct.judge(tests)
    assert [x.above for x in tests[:2]] == [True, False]
    assert tests[0].text.startswith("control ABOVE acc[frozen] (one-sided p ")
    assert ct.includes_frozen("concept-ot") and not ct.includes_frozen("c3")


def test_train_compare_tests_the_rows_of_a_control_run(tmp_path):
    """`train compare` given a run and its control (config.json control: shuffled): each control row carries the
    exact test's outcome, Holm over the table's control rows; the trained run's rows carry none."""
    import json

    from train.eval.compare import compare
    from train.eval.harness import write_results

    base = {"job": "c3", "variant": "v", "checkpoint": "c", "step": 5, "benchmark": "c3_mcp", "metric": "acc",
            "n": 560, "skipped": 0, "skip_reasons": "{}", "unit": "%", "note": ""}
    runs = []
    for name, control, k in (("run", "none", 300), ("ctl", "shuffled", 3)):
        d = tmp_path / name
        lo, hi = wilson(k, 560)
        write_results([{**base, "subset": "all", "value": 100 * k / 560, "chance": 100 / 560, "ci_low": lo,
                        "ci_high": hi}], d / "eval" / "final")
        (d / "config.json").write_text(json.dumps({"seed": 0, "control": control}))
        runs.append(d)
    text = compare(runs)
    head, row = text.splitlines()[0], text.splitlines()[2]
    assert "c3/v s0" in head and "c3/v control=shuffled s0" in head
    run_cell, ctl_cell = row.split(" | ")[4:6]
    assert "control" not in run_cell
    assert ctl_cell.endswith("; control not above chance (one-sided p 0.08, Holm)) |"), ctl_cell
