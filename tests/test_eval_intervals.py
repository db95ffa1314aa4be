"""The 95% intervals of results rows: Wilson against scipy, the vectorised bootstraps against a
brute-force loop over resamples with the same seed, and the columns in results tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from train.eval import intervals as iv
from train.eval.benchmarks._common import group_rows, macro_row, pooled_row
from train.eval.harness import compare, markdown_table, retrieval_rows, write_results
from train.eval.interface import RESULT_COLUMNS, Row


@pytest.mark.parametrize("k,n", [(0, 1), (0, 10), (3, 10), (10, 10), (57, 200), (1, 3), (499, 1000)])
def test_wilson_matches_scipy(k, n):
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = iv.wilson(k, n, scale=1.0)
    assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)
    lo100, hi100 = iv.wilson(k, n)  # percent by default
    assert lo100 == pytest.approx(100 * ci.low) and hi100 == pytest.approx(100 * ci.high)


def test_wilson_of_empty_is_nan():
    assert all(math.isnan(x) for x in iv.wilson_of(np.zeros(0, bool)))


def _brute(stat, n, resamples, seed):
    rng = np.random.default_rng(seed)
    return np.array([stat(rng.integers(0, n, size=n)) for _ in range(resamples)])


def _auc(pos, neg):
    return np.mean([(p > q) + 0.5 * (p == q) for p in pos for q in neg])


def test_mean_bootstrap_matches_a_loop():
    v = np.random.default_rng(1).random(23)
    got = iv.mean_boot(v, resamples=200, seed=7)
    want = _brute(lambda i: v[i].mean(), v.size, 200, 7)
    np.testing.assert_allclose(got, want)
    assert iv.mean_interval(v, 100.0, 200, 7) == pytest.approx(tuple(100 * np.percentile(want, [2.5, 97.5])))


def test_mean_bootstrap_in_blocks_is_the_same(monkeypatch):
    v = np.random.default_rng(2).random(50)
    whole = iv.mean_boot(v, resamples=100, seed=3)
    monkeypatch.setattr(iv, "CHUNK_ELEMENTS", 170)  # 3 resamples per block
    np.testing.assert_allclose(iv.mean_boot(v, resamples=100, seed=3), whole)


def test_auc_bootstrap_matches_a_loop():
    r = np.random.default_rng(4)
    pos, neg = r.integers(0, 6, 17).astype(float), r.integers(0, 5, 17).astype(float)  # ties on purpose
    got = iv.auc_boot(pos, neg, resamples=150, seed=11)
    want = _brute(lambda i: _auc(pos[i], neg[i]), pos.size, 150, 11)
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert iv.auc_interval(pos, neg, 150, 11) == pytest.approx(tuple(np.percentile(want, [2.5, 97.5])))


def test_macro_bootstrap_matches_a_loop():
    r = np.random.default_rng(5)
    v = r.random(30) > 0.4
    g = np.array(["b"] * 12 + ["a"] * 18)
    boots = iv.group_means_boot(v, g, resamples=100, seed=9)
    rng = np.random.default_rng(9)  # groups in sorted order, one stream
    want = {}
    for name in ("a", "b"):
        vals = v[g == name].astype(float)
        want[name] = np.array([vals[rng.integers(0, vals.size, vals.size)].mean() for _ in range(100)])
    for name in ("a", "b"):
        np.testing.assert_allclose(boots[name], want[name])
    np.testing.assert_allclose(iv.macro([boots["a"], boots["b"]]), (want["a"] + want["b"]) / 2)


def test_benchmark_rows_carry_intervals():
    correct = np.array([True] * 30 + [False] * 10 + [True] * 5 + [False] * 15)
    groups = ["x"] * 40 + ["y"] * 20
    rows = group_rows("b", groups, correct, 0.5)
    x = rows[0]
    ci = binomtest(30, 40).proportion_ci(method="wilson")
    assert (x.ci_low, x.ci_high) == pytest.approx((100 * ci.low, 100 * ci.high))
    m = macro_row("b", "all", rows)
    assert m.ci_low < m.value < m.ci_high and m.boot is not None
    p = pooled_row("b", "all", correct, 0.5)
    assert p.ci_low < p.value < p.ci_high
    assert "no interval" in macro_row("b", "all", [Row("b", "x", "accuracy", 50.0, 4, 50.0)]).note


def test_retrieval_rows_bootstrap_over_queries():
    S = np.random.default_rng(0).random((20, 40))
    img_of_caption = np.repeat(np.arange(20), 2)
    for r in retrieval_rows("ret", "score", S, img_of_caption, ks=(1, 5)):
        assert r.ci_low <= r.value <= r.ci_high and 0 <= r.ci_low and r.ci_high <= 100


def test_results_table_and_compare_show_intervals(tmp_path):
    a = tmp_path / "a" / "eval" / "step5"
    a.mkdir(parents=True)
    row = Row("b", "all", "accuracy", 75.0, 40, 50.0).with_ci((60.1, 85.8))
    bare = Row("own", "all", "loss", 1.5, 3, None, unit="").no_interval("a loss, no items")
    table = [{"job": "j", "variant": "v", "checkpoint": "c", "step": 5, **r.as_dict()} for r in (row, bare)]
    write_results(table, a)
    import pyarrow.parquet as pq

    t = pq.read_table(a / "results.parquet")
    assert tuple(t.column_names) == RESULT_COLUMNS
    assert t.column("ci_low").to_pylist()[0] == 60.1 and math.isnan(t.column("ci_high").to_pylist()[1])
    assert "no interval: a loss, no items" in t.column("note").to_pylist()[1]
    assert "75.0 [60.1, 85.8] %" in markdown_table(table)
    out = compare([tmp_path / "a"])
    assert "75.0 [60.1, 85.8] % (n=40)" in out and "| 1.5 (n=3)" in out
