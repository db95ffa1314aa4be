"""The 95% intervals of results rows: Wilson against scipy, the vectorised cluster bootstraps against
a brute-force loop over resampled images with the same seed, the coverage of every metric kind
simulated with a known truth, and the columns in results tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from train.eval import intervals as iv
from train.eval.benchmarks._common import group_rows, macro_row, pooled_row
from train.eval.compare import compare
from train.eval.harness import markdown_table, retrieval_rows, write_results
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


def test_cluster_bootstrap_of_the_mean_matches_a_loop_over_images():
    r = np.random.default_rng(1)
    v = r.random(23)
    img = r.integers(0, 9, 23)
    got = iv.mean_boot(iv.mean(v, img), resamples=200, seed=7)
    imgs = np.unique(img)

    def stat(draw):  # draw: indices into the images; every item of a drawn image, as often as drawn
        items = np.concatenate([np.flatnonzero(img == imgs[d]) for d in draw])
        return v[items].mean()

    want = _brute(stat, imgs.size, 200, 7)
    np.testing.assert_allclose(got, want)


def test_bootstrap_in_blocks_is_the_same(monkeypatch):
    v = np.random.default_rng(2).random(50)
    whole = iv.mean_boot(iv.mean(v), resamples=100, seed=3)
    monkeypatch.setattr(iv, "CHUNK_ELEMENTS", 170)  # 3 resamples per block
    np.testing.assert_allclose(iv.mean_boot(iv.mean(v), resamples=100, seed=3), whole)


def test_auc_cluster_bootstrap_matches_a_loop():
    r = np.random.default_rng(4)
    pos, neg = r.integers(0, 6, 17).astype(float), r.integers(0, 5, 17).astype(float)  # ties on purpose
    img = r.integers(0, 6, 17)
    imgs = np.unique(img)

    def stat(draw):
        items = np.concatenate([np.flatnonzero(img == imgs[d]) for d in draw])
        return _auc(pos[items], neg[items])

    got = iv.auc_boot(pos, neg, resamples=150, seed=11, clusters=img)
    np.testing.assert_allclose(got, _brute(stat, imgs.size, 150, 11), atol=1e-12)
    assert iv.auc(pos, neg) == pytest.approx(_auc(pos, neg))


def test_clustered_variance_is_the_sandwich_over_images():
    """A plain proportion's clustered variance against the sandwich formula written out."""
    r = np.random.default_rng(3)
    y = (r.random(40) < 0.4).astype(float)
    img = np.repeat(np.arange(10), 4)
    var, nc = iv.clustered_variance(iv.proportion(y, img))
    p = y.mean()
    u = np.array([(y[img == c] - p).sum() / 40 for c in range(10)])
    assert nc == 10 and var == pytest.approx(np.sum(u * u) * 10 / 9)  # C / (C - 1) for C = 10 images


def test_degenerate_intervals_have_width():
    assert iv.wilson_of(np.zeros(50, bool), 100.0)[1] == pytest.approx(100 * 3.8415 / (50 + 3.8415), rel=1e-3)
    lo, hi = iv.wilson_of(np.zeros(50, bool), 100.0, clusters=np.repeat(np.arange(10), 5))
    assert lo == 0 and hi > iv.wilson(0, 50)[1]  # 10 images hold 50 items: wider than 50 independent ones
    lo, hi = iv.interval(iv.macro([iv.proportion([True], [i]) for i in range(200)]), 100.0)
    assert hi == 100 and lo < 99  # 200 one-item groups, all right: not [100, 100]


# -- coverage: 1,000 replications of each metric kind with a known truth and image clustering ----

REPS = 1000


def _coverage(draw, truth, seed=123) -> float:
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(REPS):
        lo, hi = draw(rng)
        hits += lo <= truth <= hi
    return 100.0 * hits / REPS


def _images(rng, n_img, per, p, icc):
    """0/1 outcomes of ``per`` items on each of ``n_img`` images, the image's rate drawn from a Beta
    of mean ``p`` and intra-image correlation ``icc`` (beta-binomial): the truth is ``p``."""
    a, b = p * (1 - icc) / icc, (1 - p) * (1 - icc) / icc
    q = rng.beta(a, b, n_img)
    return (rng.random((n_img, per)) < q[:, None]).reshape(-1), np.repeat(np.arange(n_img), per)


def _macro_draw(n_groups, n_items, n_img, p_lo, p_hi):
    """Groups of 1+ items (one-item groups included), each with its own rate, items on shared
    images; the truth is the mean of the groups' rates."""
    def draw(rng, pg):
        sizes = 1 + np.bincount(rng.integers(0, n_groups, n_items - n_groups), minlength=n_groups)
        g = np.repeat(np.arange(n_groups), sizes)
        img = rng.integers(0, n_img, g.size)
        y = rng.random(g.size) < pg[g]
        return iv.interval(iv.macro([iv.proportion(y[g == k], img[g == k]) for k in range(n_groups)]), 1.0)
    pg = np.linspace(p_lo, p_hi, n_groups)
    return (lambda rng: draw(rng, pg)), float(pg.mean())


@pytest.mark.parametrize("case", [
    "proportion n=40 p=0.3",
    "proportion n=60 p=0.03 (0 hits in 16% of draws)",
    "proportion n=60 p=0.97 (all hits in 16% of draws)",
    "clustered proportion 30 images x 4, icc 0.3",
    "clustered proportion 20 images x 5, icc 0.5",
    "clustered proportion p=0.01, 40 images x 5, icc 0.3 (0 hits in 29% of draws)",
    "macro 66 groups over 169 items (VG-Attribution's size)",
    "macro 200 one-item groups",
    "macro 10 groups x 10",
])
def test_binary_intervals_cover(case):
    if case.startswith("proportion"):
        n, p = {"n=40": (40, 0.3), "n=60 p=0.03": (60, 0.03), "n=60 p=0.97": (60, 0.97)}[
            next(k for k in ("n=40", "n=60 p=0.03", "n=60 p=0.97") if k in case)]
        got = _coverage(lambda rng: iv.wilson_of(rng.random(n) < p, 1.0), p)
    elif case.startswith("clustered"):
        n_img, per, p, icc = {"30 images": (30, 4, 0.4, 0.3), "20 images": (20, 5, 0.3, 0.5),
                              "p=0.01": (40, 5, 0.01, 0.3)}[next(k for k in ("30 images", "20 images", "p=0.01")
                                                                  if k in case)]
        def draw(rng):
            y, img = _images(rng, n_img, per, p, icc)
            return iv.wilson_of(y, 1.0, clusters=img)
        got = _coverage(draw, p)
    else:
        args = {"66 groups": (66, 169, 100, 0.4, 0.8), "200 one-item": (200, 200, 150, 0.4, 0.8),
                "10 groups": (10, 100, 25, 0.4, 0.6)}[next(k for k in ("66 groups", "200 one-item", "10 groups")
                                                          if k in case)]
        draw, truth = _macro_draw(*args)
        got = _coverage(draw, truth)
    assert 93.0 <= got <= 97.0, f"{case}: the 95% interval covered the truth in {got:.1f}% of {REPS} draws"


def test_cluster_bootstrap_mean_covers():
    """Per-item values in (0, 1) (an IoU-like skewed metric) on 30 images of 4 items that share an
    image effect; the truth E[sigmoid(Z - 0.5)], Z ~ N(0, 1), by quadrature."""
    from scipy.integrate import quad
    from scipy.stats import norm

    truth = quad(lambda z: norm.pdf(z) / (1 + np.exp(-(z - 0.5))), -12, 12)[0]

    def draw(rng):
        img = np.repeat(np.arange(30), 4)
        z = rng.normal(0, np.sqrt(0.3), 30)[img] + rng.normal(0, np.sqrt(0.7), img.size)
        return iv.mean_interval(1 / (1 + np.exp(-(z - 0.5))), 1.0, resamples=400, seed=rng, clusters=img)

    got = _coverage(draw, truth)
    assert 93.0 <= got <= 97.0, got


def test_cluster_bootstrap_auc_covers():
    """Paired AUC of 30 images x 3 triplets whose scores share an image shift (s = 0.7): the truth
    Phi(d / sqrt(2 (1 + s^2)))."""
    from scipy.stats import norm

    d, s = 0.8, 0.7
    truth = float(norm.cdf(d / np.sqrt(2 * (1 + s * s))))

    def draw(rng):
        img = np.repeat(np.arange(30), 3)
        e = rng.normal(0, s, 30)[img]
        pos, neg = d + e + rng.normal(size=img.size), e + rng.normal(size=img.size)
        return iv.auc_interval(pos, neg, resamples=400, seed=rng, clusters=img)

    got = _coverage(draw, truth)
    assert 93.0 <= got <= 97.0, got


def test_benchmark_rows_carry_intervals():
    correct = np.array([True] * 30 + [False] * 10 + [True] * 5 + [False] * 15)
    groups = ["x"] * 40 + ["y"] * 20
    rows = group_rows("b", groups, correct, 0.5)
    x = rows[0]
    ci = binomtest(30, 40).proportion_ci(method="wilson")
    assert (x.ci_low, x.ci_high) == pytest.approx((100 * ci.low, 100 * ci.high))
    m = macro_row("b", "all", rows)
    assert m.ci_low < m.value < m.ci_high and m.est is not None
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
    assert "75.0 [60.1, 85.8] % (n=40; above)" in out and "| 1.5 (n=3) |" in out


def test_wilson_ends_are_exact_at_zero_and_all_hits():
    """0 of 12 gives a lower end of exactly 0 (not 2.8e-15 from rounding), 12 of 12 an upper end of 100."""
    assert iv.wilson(0, 12)[0] == 0.0 and iv.wilson(12, 12)[1] == 100.0
    assert iv.wilson_of(np.zeros(12, bool), clusters=np.repeat(np.arange(4), 3))[0] == 0.0


def test_widened_bootstrap_stays_inside_the_values():
    """The sqrt(C / (C - 1)) widening never takes a mean past its values (recall 100% of every image)."""
    lo, hi = iv.mean_interval(np.r_[np.ones(30), 0.98], 100.0, clusters=np.arange(31))
    assert hi <= 100.0 and lo >= 98.0
    # an AUC of 1 (every pair ordered right: no spread to measure) is not [1, 1]: Wilson with every image one
    # observation, t with 19 degrees of freedom, as a proportion's all-hits case
    lo, hi = iv.auc_interval(np.ones(20), np.zeros(20), clusters=np.arange(20))
    want = iv.wilson_n(1.0, 20 * (iv.Z95 / iv._t975(19)) ** 2, 1.0)
    assert (lo, hi) == pytest.approx(want) and hi == 1.0 and lo < 0.9


# -- coverage at 4,000 draws per seed, two seeds: the regimes the project's tables hold -----------------
# 4,000 draws give an observed coverage a standard error of 0.34 points: a 95% method lands inside 93-97 at any seed
# (almost 6 standard errors), a 91% one never; the upper end lets a small-sample method be a little conservative.


def _clustered_prop(n_img, per, p, icc):
    def draw(rng):
        y, img = _images(rng, n_img, per, p, icc)
        return iv.wilson_of(y, 1.0, clusters=img)
    return draw, p


def _iou_like(n_img, per):
    from scipy.integrate import quad
    from scipy.stats import norm

    truth = quad(lambda z: norm.pdf(z) / (1 + np.exp(-(z - 0.5))), -12, 12)[0]

    def draw(rng):
        img = np.repeat(np.arange(n_img), per)
        z = rng.normal(0, np.sqrt(0.3), n_img)[img] + rng.normal(0, np.sqrt(0.7), img.size)
        return iv.mean_interval(1 / (1 + np.exp(-(z - 0.5))), 1.0, resamples=400, seed=rng, clusters=img)
    return draw, truth


def _auc_case(n_img, per, d, s=0.7):
    from scipy.stats import norm

    truth = float(norm.cdf(d / np.sqrt(2 * (1 + s * s))))

    def draw(rng):
        img = np.repeat(np.arange(n_img), per)
        e = rng.normal(0, s, n_img)[img]
        pos, neg = d + e + rng.normal(size=img.size), e + rng.normal(size=img.size)
        return iv.auc_interval(pos, neg, resamples=400, seed=rng, clusters=img)
    return draw, truth


BIG_CASES = {
    "clustered proportion 6 images x 5, icc 0.3": lambda: _clustered_prop(6, 5, 0.4, 0.3),
    "clustered proportion 10 images x 5, icc 0.3": lambda: _clustered_prop(10, 5, 0.4, 0.3),
    "rare: proportion n=1000 p=0.002 (0 hits in 13% of draws)": lambda: (
        lambda rng: iv.wilson_of(rng.random(1000) < 0.002, 1.0), 0.002),
    "rare: p=0.002 on 400 images x 5, icc 0.3": lambda: _clustered_prop(400, 5, 0.002, 0.3),
    "bootstrap mean 6 images x 4": lambda: _iou_like(6, 4),
    "bootstrap mean 10 images x 4": lambda: _iou_like(10, 4),
    "AUC 10 images x 3": lambda: _auc_case(10, 3, 0.8),
    "AUC near 1 (0.99), 100 images x 3": lambda: _auc_case(100, 3, 4.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BIG_CASES))
def test_intervals_cover_at_4000_draws_over_two_seeds(case):
    draw, truth = BIG_CASES[case]()
    for seed in (11, 12):
        rng = np.random.default_rng(seed)
        hits = sum(lo <= truth <= hi for lo, hi in (draw(rng) for _ in range(4000)))
        assert 93.0 <= hits / 40 <= 97.0, f"{case}, seed {seed}: covered the truth in {hits / 40:.2f}% of 4,000 draws"
