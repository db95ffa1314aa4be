"""The paired difference of a result from its baseline over the same resampled images
(train.eval.intervals.paired_difference): against a brute-force loop, its coverage simulated with a
known truth, the harness filling diff_vs / diff / diff_low / diff_high, and the verdicts it decides."""

from __future__ import annotations

import math

import numpy as np
import pytest

from train.eval import intervals as iv


def _clustered(rng, C, m, p_res, p_base, spread=1.0):
    """C images of m items each: a result and a baseline 0/1 outcome per item, both sharing each image's
    random effect (the images are what make the items dependent), true rates p_res and p_base."""
    from scipy.stats import norm

    u = rng.normal(size=(C, 1)) * spread
    e = rng.normal(size=(C, m))
    s = math.sqrt(1 + spread * spread)
    res = (u + e < norm.ppf(p_res) * s).reshape(-1)
    base = (u + rng.normal(size=(C, m)) < norm.ppf(p_base) * s).reshape(-1)
    return res.astype(float), base.astype(float), np.repeat(np.arange(C), m)


def test_paired_difference_matches_a_loop_over_resampled_images():
    rng = np.random.default_rng(3)
    res, base, img = _clustered(rng, 9, 3, 0.7, 0.5)
    img = np.asarray([f"im{i}" for i in img])
    d, lo, hi = iv.paired_difference(iv.proportion(res, img), iv.proportion(base, img), 100.0, resamples=300, seed=11)
    imgs = np.unique(img)
    draws = np.random.default_rng(11)
    stats = []
    for _ in range(300):  # one draw of images for both: every item of a drawn image, as often as drawn
        items = np.concatenate([np.flatnonzero(img == imgs[k]) for k in draws.integers(0, imgs.size, imgs.size)])
        stats.append(res[items].mean() - base[items].mean())
    p_lo, p_hi = np.percentile(stats, [2.5, 97.5])
    centre = res.mean() - base.mean()
    w = iv.small_cluster_widening(imgs.size)
    assert d == pytest.approx(100 * centre)
    assert lo == pytest.approx(100 * (centre - w * (centre - p_lo)))
    assert hi == pytest.approx(100 * (centre + w * (p_hi - centre)))


def test_paired_difference_is_narrower_than_two_separate_intervals_when_the_two_move_together():
    """The same images resampled for both: a baseline that fails where the result fails cancels out."""
    rng = np.random.default_rng(0)
    res, _, img = _clustered(rng, 40, 5, 0.6, 0.5, spread=2.0)
    base = res.copy()
    base[rng.choice(res.size, 12, replace=False)] = 0  # the result right on 12 more items, same images otherwise
    d, lo, hi = iv.paired_difference(iv.proportion(res, img), iv.proportion(base, img), 100.0)
    r_lo, r_hi = iv.interval(iv.proportion(res, img), 100.0)
    assert lo > 0 and hi - lo < (r_hi - r_lo) / 2, (d, lo, hi, r_lo, r_hi)


def test_paired_difference_refuses_estimates_over_other_items():
    a = iv.proportion([1, 0, 1, 1], ["a", "a", "b", "c"])
    with pytest.raises(ValueError, match=r"^paired_difference: 4 result items against 3 baseline items$"):
        iv.paired_difference(a, iv.proportion([1, 0, 1], ["a", "a", "b"]))
    with pytest.raises(ValueError, match=r"^paired_difference: item 3's image differs \('c' in the result, 'd' in "
                                         r"the baseline\): the two are not over the same items in the same order$"):
        iv.paired_difference(a, iv.proportion([1, 0, 1, 1], ["a", "a", "b", "d"]))


@pytest.mark.parametrize("true_diff", [0.0, 0.15])
def test_paired_difference_covers_the_true_difference(true_diff):
    """Image-clustered items (30 images of 4), result and baseline sharing each image's random effect:
    the 95% interval of the difference covers the true difference 93-97% of 2,000 draws."""
    rng = np.random.default_rng(5 if true_diff else 6)
    reps, hits = 2000, 0
    p_base = 0.5
    for k in range(reps):
        res, base, img = _clustered(rng, 30, 4, p_base + true_diff, p_base)
        _, lo, hi = iv.paired_difference(iv.proportion(res, img), iv.proportion(base, img), 1.0, resamples=400, seed=k)
        hits += lo <= true_diff <= hi
    assert 0.93 <= hits / reps <= 0.97, hits / reps


def _clustered_reader(spec, samples_dir):
    """40 images of 3 items each: item k of image i is right under the learnt score when (i + k) % 5 < 4
    (80%), under the frozen score when (i + k) % 2 == 0 (about 50%)."""
    from train.eval.interface import BenchData, Item, Pair

    items = [Item([Pair(f"sample_id:{i}", f"right {i} {k}"), Pair(f"sample_id:{i}", f"wrong {i} {k}")],
                  key=f"{i}/{k}") for i in range(1, 41) for k in range(3)]
    return BenchData(spec.name, items, score=_scored_with_estimates, total=len(items))


def _scored_with_estimates(items, scores):
    from train.eval.interface import Row

    ok = np.array([float(s[0] > s[1]) for s in scores])
    img = [it.pairs[0].image for it in items]
    est = iv.proportion(ok, img)
    return [Row("clustered", "all", "acc", 100 * est.value, len(ok), 50.0, est=est).with_ci(iv.interval(est, 100.0))]


class _FrozenJob:
    """concept-ot's shape: a learnt score and, beside it, the frozen score it starts from (has_frozen_baseline),
    plus the job's own metric rows: one with a baseline over the same items, one whose baseline has no estimate."""

    NAME = "frozen-toy"
    crop_note = ""

    def __init__(self):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(variant="v", seed=0)

    def scorable_sample_ids(self):
        return set(range(1, 41))

    @staticmethod
    def _score(texts, right):
        out = []
        for t in texts:
            kind, i, k = t.split()
            out.append(1.0 if (kind == "right") == right(int(i), int(k)) else 0.0)
        return np.array(out)

    def score_pairs(self, model, sids, texts, boxes=None):
        return self._score(texts, lambda i, k: (i + k) % 5 < 4)

    def has_frozen_baseline(self):
        return True

    def score_pairs_frozen(self, model, sids, texts, boxes=None):
        return self._score(texts, lambda i, k: (i + k) % 2 == 0)

    def job_metrics(self, model, out_dir):
        from train.eval.interface import Row

        img = np.repeat(np.arange(20), 2)
        learnt, prior = iv.mean(np.linspace(0.2, 0.9, 40), img), iv.mean(np.linspace(0.1, 0.5, 40), img)
        other = iv.mean(np.linspace(0.1, 0.5, 40), np.repeat(np.arange(10), 4))
        rows = [Row("own", "held_out", "iou", learnt.value, 40, 0.1, unit="fraction", est=learnt),
                Row("own", "held_out", "iou[prior]", prior.value, 40, 0.1, unit="fraction", est=prior,
                    baseline_for="held_out/iou"),
                Row("own", "held_out", "recall", 60.0, 40, 10.0, baseline_for=""),
                Row("own", "held_out", "recall[prior]", 30.0, 40, 10.0, baseline_for="held_out/recall"),
                Row("own", "other", "iou", learnt.value, 40, 0.1, unit="fraction", est=learnt),
                Row("own", "other", "iou[prior]", other.value, 40, 0.1, unit="fraction", est=other,
                    baseline_for="other/iou")]
        return [r.with_ci(iv.interval(r.est)) if r.est is not None else r for r in rows]


def test_the_harness_pairs_each_result_with_its_strongest_baseline_on_the_same_images(tmp_path, monkeypatch):
    """The frozen baseline rows (score_pairs_frozen) and a job's own baseline rows: each result row gets
    diff_vs / diff / diff_low / diff_high, the interval the paired bootstrap over the result's images gives;
    a baseline without a per-item estimate, or over other images, leaves a note and no paired interval."""
    import pyarrow.parquet as pq
    import torch

    from pipeline.report.significance import verdicts
    from tests.test_eval_harness import _manifest
    from train.eval import harness as H
    from train.eval.interface import RESULT_COLUMNS

    monkeypatch.setitem(H.BUILTIN, "clustered", _clustered_reader)
    out = tmp_path / "o"
    rows, errors = H.run_harness(_FrozenJob(), torch.nn.Linear(1, 1), _manifest(tmp_path, [("b", "clustered", None)]),
                                 out, log=lambda s: None)
    assert errors == []
    by = {(r["benchmark"], r["subset"], r["metric"]): r for r in rows}
    r, f = by[("clustered", "all", "acc")], by[("clustered", "all", "acc[frozen]")]
    # the same estimate rebuilt by hand: 40 images of 3 items, learnt and frozen outcomes
    img = [f"sample_id:{i}" for i in range(1, 41) for _ in range(3)]
    learnt = np.array([float((i + k) % 5 < 4) for i in range(1, 41) for k in range(3)])
    frozen = np.array([float((i + k) % 2 == 0) for i in range(1, 41) for k in range(3)])
    want = iv.paired_difference(iv.proportion(learnt, img), iv.proportion(frozen, img), 100.0)
    assert r["diff_vs"] == "acc[frozen]" and (r["diff"], r["diff_low"], r["diff_high"]) == pytest.approx(want)
    assert r["diff"] == pytest.approx(r["value"] - f["value"]) and want[1] > 0
    assert math.isnan(f["diff_low"]) and f["diff_vs"] == ""  # a baseline is not paired with anything
    own, own_other = by[("own", "held_out", "iou")], by[("own", "other", "iou")]
    assert own["diff_vs"] == "iou[prior]" and own["diff_low"] < own["diff"] < own["diff_high"]
    rec = by[("own", "held_out", "recall")]
    assert rec["diff_vs"] == "recall[prior]" and rec["diff"] == pytest.approx(30.0) and math.isnan(rec["diff_low"])
    assert rec["note"] == ("no paired interval: the result has no per-item estimate; "
                           "no interval: its scorer gave no per-item outcomes")
    assert math.isnan(own_other["diff_low"]) and own_other["note"] == (
        "no paired interval: item 2's image differs ('1' in the result, '0' in the baseline): the two are not over "
        "the same items in the same order")
    # the columns are written, and the verdicts read them: no paired interval, no verdict
    t = pq.read_table(out / "results.parquet")
    assert tuple(t.column_names) == RESULT_COLUMNS and t.column("diff_vs").to_pylist().count("acc[frozen]") == 1
    v = dict(zip([(x["benchmark"], x["subset"], x["metric"]) for x in rows], verdicts(rows)))
    assert v[("clustered", "all", "acc")] == "above" and v[("clustered", "all", "acc[frozen]")] == "baseline"
    assert v[("own", "held_out", "recall")] is None and v[("own", "other", "iou")] is None
    md = (out / "results.md").read_text()
    line = next(ln for ln in md.splitlines() if "| acc |" in ln)
    assert line.endswith(f"| above | +{want[0]:.1f} [+{want[1]:.1f}, +{want[2]:.1f}] vs acc[frozen] |"), line


ROW = {"benchmark": "b", "subset": "all", "metric": "acc", "value": 70.0, "n": 500, "chance": 50.0,
       "ci_low": 66.0, "ci_high": 74.0, "unit": "%"}


@pytest.mark.parametrize("extra,want", [
    ({"diff_vs": "acc[frozen]", "diff": 5.0, "diff_low": 1.0, "diff_high": 9.0}, "above"),
    # above its baseline but not above chance: not 'above'
    ({"diff_vs": "acc[frozen]", "diff": 5.0, "diff_low": 1.0, "diff_high": 9.0, "ci_low": 48.0}, "not resolved"),
    ({"diff_vs": "acc[frozen]", "diff": -5.0, "diff_low": -9.0, "diff_high": -1.0}, "below"),
    ({"diff_vs": "acc[frozen]", "diff": 0.5, "diff_low": -1.0, "diff_high": 2.0}, "not resolved"),
    # a baseline without a paired interval: never compared as a constant
    ({"diff_vs": "acc[frozen]", "diff": 5.0, "diff_low": float("nan"), "diff_high": float("nan")}, None),
    # no baseline: against chance by the row's own interval
    ({}, "above"), ({"ci_low": 45.0}, "not resolved"), ({"ci_low": 30.0, "ci_high": 40.0}, "below"),
    # no interval, no verdict (no Wilson fallback on a macro row the harness left without one)
    ({"ci_low": float("nan"), "ci_high": float("nan"), "note": "no interval: a row it averages has no per-item "
      "estimate"}, None),
    ({"ci_low": None, "ci_high": None}, None),
])
def test_paired_verdicts_on_hand_made_rows(extra, want):
    from pipeline.report.significance import verdict

    assert verdict({**ROW, **extra}) == want


def test_a_baseline_reported_beside_a_row_without_paired_columns_gives_no_verdict():
    """Older results (no diff columns): the baseline exists, so a verdict against chance alone would be the
    'not a pass' case; no verdict."""
    from pipeline.report.significance import diff_text, verdicts

    rows = [ROW, {**ROW, "metric": "acc[frozen]", "value": 60.0, "baseline_for": "all/acc"}]
    assert verdicts(rows) == [None, "baseline"]
    assert diff_text({**ROW, "diff_vs": "acc[frozen]", "diff": 2.0, "diff_low": 0.5, "diff_high": 3.5}) == \
        "+2 [+0.5, +3.5] vs acc[frozen]"


def _weighted_auc(pos, neg, w):
    gt = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    return float((w[:, None] * w[None, :] * gt).sum() / w.sum() ** 2)


def test_two_way_auc_bootstrap_and_its_paired_difference_match_a_loop():
    """c3's AUC: each triplet clustered by its anchor image and by its negative's image, the two ways drawn
    independently (the item weighted by the product of its two images' counts); a baseline AUC over the same
    triplets paired with it under the same draws."""
    r = np.random.default_rng(4)
    n = 24
    a_img, n_img = r.integers(0, 7, n), r.integers(0, 5, n)
    pos, neg = r.normal(1, 1, n), r.normal(0, 1, n)
    bpos, bneg = pos + r.normal(0, 1, n), neg + r.normal(0, 1, n)
    est = iv.auc_estimate(pos, neg, a_img, n_img)
    base = iv.auc_estimate(bpos, bneg, a_img, n_img)
    got = iv.boot(est, resamples=150, seed=9)
    rng = np.random.default_rng(9)
    rng2 = np.random.default_rng(rng.integers(2**63))
    want, diffs = [], []
    u1, i1 = np.unique(a_img, return_inverse=True)
    u2, i2 = np.unique(n_img, return_inverse=True)
    for _ in range(150):
        k1 = np.bincount(rng.integers(0, u1.size, u1.size), minlength=u1.size)
        k2 = np.bincount(rng2.integers(0, u2.size, u2.size), minlength=u2.size)
        w = (k1[i1] * k2[i2]).astype(float)
        want.append(_weighted_auc(pos, neg, w) if w.sum() else np.nan)
        diffs.append(want[-1] - _weighted_auc(bpos, bneg, w) if w.sum() else np.nan)
    np.testing.assert_allclose(got, want)
    d, lo, hi = iv.paired_difference(est, base, resamples=150, seed=9)
    diffs = np.asarray(diffs)
    p_lo, p_hi = np.percentile(diffs[np.isfinite(diffs)], [2.5, 97.5])
    w = iv.small_cluster_widening(5)  # the fewer images of the two ways
    assert d == pytest.approx(iv.auc(pos, neg) - iv.auc(bpos, bneg))
    assert (lo, hi) == pytest.approx((d - w * (d - p_lo), d + w * (p_hi - d)))
    with pytest.raises(ValueError, match=r"^paired_difference: only one of the two is clustered by a second image"):
        iv.paired_difference(est, iv.auc_estimate(bpos, bneg, a_img))
