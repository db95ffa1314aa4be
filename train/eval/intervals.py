"""95% intervals for every results row (``ci_low``, ``ci_high``): the one place that chooses them.

Every metric the harness and the jobs report is one of four kinds; each kind has one estimator,
chosen for what the metric is and for which items share an image (an image is the independent
unit of every benchmark here: five captions of one image, the phrases of one caption, the
triplets built on one anchor image are not independent draws):

=================================  ========================================================================
kind (constructor)                 95% interval
=================================  ========================================================================
proportion (:func:`proportion`)    Wilson score interval. Items that share an image: Wilson on the
  accuracy, pointing accuracy,     *effective* sample size n / deff (Kish; Korn & Graubard 1998), the
  pairwise accuracy, recall@k      design effect deff = (image-clustered variance) / (binomial variance),
                                   the clustered variance the sandwich over C images times C / (C - 1);
                                   where the images shrink it below n it is shrunk by (z / t_{C-1})^2 (the
                                   small-cluster correction of every path). 0 hits, all hits, or the
                                   rarer outcome on one image (no spread across images to measure):
                                   every image one observation (effective n = min(n, C)), so the
                                   interval never has zero width.
macro average (:func:`macro`)      the same Wilson-on-effective-n, the variance of the macro taken over
  of proportions over groups       images across all groups at once (one image's items in several groups
  (VALSE pieces, ARO relations)    move together); a group's residuals are scaled by n_g / (n_g - 1), a
                                   one-item group's measured against the pooled rate (it cannot measure
                                   its own), so one-item groups add the variance they really carry.
mean of per-item values            cluster bootstrap: resample images (all of an image's items together),
  (:func:`mean`; IoU, tIoU,        recompute the weighted mean, percentile interval widened by
  cosine, per-image recall)        sqrt(C / (C - 1)) * t_{C-1} / z (:func:`small_cluster_widening`).
paired AUC (:func:`auc_estimate`)  Wilson on the AUC's effective number of pairs A (1 - A) / var, var the
                                   cluster bootstrap's variance (each resampled image's positive and
                                   negative scores weighted by its count) times C / (C - 1), shrunk by
                                   (z / t_{C-1})^2; an AUC of 0 or 1: every image one observation.
                                   Optionally clustered two ways (``clusters2``: the negative's image),
                                   each way resampled independently, C the fewer images of the two.
=================================  ========================================================================

:func:`paired_difference` gives the interval of (result - baseline) over the same items: the same
bootstrap draws for both, the percentile interval widened as a mean's (the harness's ``diff_low`` /
``diff_high``, :mod:`train.eval.paired`). :func:`seeds_difference` extends it to two rows of a grid
(several seeds each, every run on the same items): the between-seed variance of the difference plus
the bootstrap's, the same images resampled for every run (``train compare --paper``,
:mod:`train.paper_orderings`).

``tests/test_eval_intervals.py`` simulates each kind with a known truth and image clustering
(1,000 replications at small n, the degenerate cases included: 0 hits, all hits, one-item groups;
its slow test 4,000 at each of two seeds, with 6 and 10 images, p = 0.002 and an AUC near 1) and
checks that the 95% interval covers the truth 93-97% of the time.

Intervals come in the row's unit: ``scale`` 100 for percentages, 1 for fractions. A seed makes
every bootstrap interval reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
RESAMPLES = 1000
SEED = 0
CHUNK_ELEMENTS = 4_000_000  # resample indices drawn at a time (bounds memory for 25K-query retrieval)
NAN2 = (float("nan"), float("nan"))


# ------------------------------------------------------------------------------ plain Wilson


def wilson_n(p: float, n: float, scale: float = 100.0) -> tuple[float, float]:
    """The 95% Wilson score interval of a rate ``p`` observed on ``n`` (possibly effective, not
    whole) items, times ``scale``; NaN for n <= 0."""
    if not n > 0 or not np.isfinite(p):
        return NAN2
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * np.sqrt(max(p * (1 - p), 0.0) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo = 0.0 if p <= 0.0 else max(0.0, centre - half)  # exact ends at 0 / all hits (no 2.8e-15 from rounding)
    hi = 1.0 if p >= 1.0 else min(1.0, centre + half)
    return scale * float(lo), scale * float(hi)


def wilson(successes: float, n: int, scale: float = 100.0) -> tuple[float, float]:
    """The 95% Wilson score interval of ``successes`` out of ``n`` independent items, times ``scale``."""
    n = int(n)
    return wilson_n(float(successes) / n, n, scale) if n > 0 else NAN2


# ------------------------------------------------------------------------------ estimates


def _labels(x, n: int) -> np.ndarray:
    """Cluster or group labels as an array of ``n`` (None: every item its own)."""
    if x is None:
        return np.arange(n)
    a = np.asarray(x)
    if a.shape[0] != n:
        raise ValueError(f"intervals: {a.shape[0]} labels for {n} items")
    return a


def _factorize(a: np.ndarray) -> tuple[np.ndarray, int]:
    if a.dtype == object:
        a = np.asarray([str(v) for v in a])
    uniq, inv = np.unique(a, return_inverse=True)
    return inv.reshape(-1), len(uniq)


@dataclass
class Estimate:
    """A metric as a weighted mean ``sum(w * y)`` of per-item values, with what its interval needs:
    ``group`` the finest groups it averages over (a macro's groups; one group for a plain mean) and
    ``cluster`` each item's image (the unit resampled). ``binary``: the items are 0/1 outcomes.
    An AUC (:func:`auc_estimate`) holds each item's positive score in ``y`` and its negative in
    ``neg``. ``cluster2``: a second image per item, resampled independently of the first (two-way
    clustering: an item shares its anchor image with some items and its negative's image with others)."""

    y: np.ndarray
    w: np.ndarray
    group: np.ndarray
    cluster: np.ndarray
    binary: bool
    neg: np.ndarray | None = None
    cluster2: np.ndarray | None = None

    @property
    def value(self) -> float:
        if self.neg is not None:
            return auc(self.y, self.neg)
        return float(np.sum(self.w * self.y)) if self.y.size else float("nan")

    @property
    def n(self) -> int:
        return int(self.y.size)


def proportion(correct, clusters=None) -> Estimate:
    """A share of items with a 0/1 outcome; ``clusters``: each item's image (None: independent)."""
    y = np.asarray(correct, dtype=np.float64).reshape(-1)
    n = y.size
    return Estimate(y, np.full(n, 1.0 / max(n, 1)), np.zeros(n, np.int64), _labels(clusters, n), True)


def mean(values, clusters=None) -> Estimate:
    """A mean of per-item values (IoU, cosine, per-image recall); ``clusters`` as in :func:`proportion`."""
    y = np.asarray(values, dtype=np.float64).reshape(-1)
    n = y.size
    return Estimate(y, np.full(n, 1.0 / max(n, 1)), np.zeros(n, np.int64), _labels(clusters, n), False)


def auc_estimate(pos, neg, clusters=None, clusters2=None) -> Estimate:
    """The AUC P(pos > neg) (ties one half) over items that each hold one positive ``pos[i]`` and one
    negative ``neg[i]`` score; ``clusters``: each item's (anchor) image, ``clusters2``: its negative's
    image where that is another (two-way clustering, :class:`Estimate`)."""
    y, ng = np.asarray(pos, np.float64).reshape(-1), np.asarray(neg, np.float64).reshape(-1)
    n = y.size
    if ng.size != n:
        raise ValueError(f"intervals: {n} positive and {ng.size} negative scores (one of each per item)")
    return Estimate(y, np.full(n, 1.0 / max(n, 1)), np.zeros(n, np.int64), _labels(clusters, n), False, ng,
                    None if clusters2 is None else _labels(clusters2, n))


def macro(parts: Sequence[Estimate]) -> Estimate:
    """The unweighted mean of several estimates (a macro average over groups, or over macros): their
    items with weights divided by their number, their groups kept apart, their images shared."""
    parts = [p for p in parts if p.n]
    if any(p.neg is not None or p.cluster2 is not None for p in parts):
        raise ValueError("intervals: a macro averages means and proportions, not AUCs or two-way clustered estimates")
    if not parts:
        return proportion(np.zeros(0))
    k = len(parts)
    groups = [np.char.add(f"{i}:", np.asarray([str(g) for g in p.group])) for i, p in enumerate(parts)]
    return Estimate(np.concatenate([p.y for p in parts]), np.concatenate([p.w / k for p in parts]),
                    np.concatenate(groups), np.concatenate([np.asarray([str(c) for c in p.cluster]) for p in parts]),
                    all(p.binary for p in parts))


# ------------------------------------------------------------------------------ the intervals


def _t975(df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def clustered_variance(est: Estimate) -> tuple[float, int]:
    """(the image-clustered sandwich variance of ``est.value``, the number of images C): the squared sums
    over images of the items' weighted residuals, times C / (C - 1) (the small-cluster correction the
    bootstrap path applies too, :func:`small_cluster_widening`; for independent items C = n, the usual
    n / (n - 1)). A macro's residuals are taken within each group instead (a group of n_g >= 2 items
    scaled by sqrt(n_g / (n_g - 1)), so that small groups do not hide their variance; a one-item group
    against the pooled mean), that scaling its correction."""
    y, w = est.y, est.w
    gi, ng = _factorize(est.group)
    ci, nc = _factorize(est.cluster)
    if nc < 2:
        return float("nan"), nc
    if ng > 1:
        size = np.bincount(gi, minlength=ng).astype(np.float64)
        m = np.bincount(gi, weights=y, minlength=ng) / np.maximum(size, 1)
        s = size[gi]
        r = np.where(s > 1, (y - m[gi]) * np.sqrt(s / np.maximum(s - 1, 1)), y - y.mean())
    else:
        r = y - float(np.sum(w * y)) / float(np.sum(w))
    u = np.bincount(ci, weights=w * r, minlength=nc)
    # one group: C / (C - 1), as the bootstrap path; a macro's groups carry their own (n_g / (n_g - 1)) scaling
    return float(np.sum(u * u)) * (nc / (nc - 1) if ng == 1 else 1.0), nc


def _minority_images(est: Estimate) -> int:
    """How many images hold an item of the rarer outcome (hits or misses)."""
    ci, _ = _factorize(est.cluster)
    hit = est.y > 0.5
    minority = hit if hit.sum() <= (~hit).sum() else ~hit
    return int(np.unique(ci[minority]).size)


def binary_interval(est: Estimate, scale: float = 100.0) -> tuple[float, float]:
    """Wilson on the effective sample size of a proportion or a macro of proportions (module doc)."""
    if est.n == 0:
        return NAN2
    v = est.value
    kish = 1.0 / float(np.sum(est.w ** 2))  # the weights' effective n (n for a plain proportion)
    var, nc = clustered_variance(est)
    clustered = nc < est.n
    n_eff = kish
    if clustered and _minority_images(est) < 2:
        n_eff = min(kish, float(nc))  # no spread across images to measure: every image one observation
    elif (clustered or np.unique(est.group).size > 1) and 0.0 < v < 1.0 and np.isfinite(var) and var > 0:
        n_eff = min(kish, v * (1 - v) / var)
    if clustered and nc >= 2 and n_eff < kish:  # the images' variance decides: C - 1 degrees of freedom, t as the
        n_eff *= (Z95 / _t975(nc - 1)) ** 2     # bootstrap path (small_cluster_widening); else the binomial's n
    return wilson_n(v, n_eff, scale)


def bootstrap_indices(n: int, resamples: int = RESAMPLES, seed=SEED):
    """Yield ``[b, n]`` blocks of indices (b <= ``resamples`` rows in all), drawn with replacement
    from one seeded generator (``seed``: an int or a ``numpy.random.Generator``); blocks keep memory
    bounded for large ``n``."""
    rng = np.random.default_rng(seed)
    per = max(1, CHUNK_ELEMENTS // max(n, 1))
    for s in range(0, resamples, per):
        yield rng.integers(0, n, size=(min(per, resamples - s), n))


def cluster_counts(ci: np.ndarray, nc: int, resamples: int = RESAMPLES, seed=SEED):
    """Yield ``[b, items]`` blocks: how often each item's image is drawn when ``nc`` images are
    resampled with replacement (every item of an image moves with it)."""
    for idx in bootstrap_indices(nc, resamples, seed):
        b = idx.shape[0]
        k = np.bincount((idx + nc * np.arange(b)[:, None]).reshape(-1), minlength=b * nc).reshape(b, nc)
        yield k[:, ci].astype(np.float64)


def percentile_interval(stats: np.ndarray, scale: float = 1.0, centre: float | None = None,
                        widen: float = 1.0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of a bootstrap distribution, times ``scale``; ``widen`` > 1
    stretches them away from ``centre`` (the estimate)."""
    s = np.asarray(stats, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return NAN2
    lo, hi = np.percentile(s, [2.5, 97.5])
    if centre is not None and widen != 1.0:
        lo, hi = centre - widen * (centre - lo), centre + widen * (hi - centre)
    return scale * float(lo), scale * float(hi)


def small_cluster_widening(nc: int) -> float:
    """How much a cluster bootstrap's percentile interval over ``nc`` images is widened about the
    estimate: sqrt(C / (C - 1)) (the plug-in variance's bias) times t_{C-1} / z (the few degrees of
    freedom C images give): the correction the Wilson path applies as well (:func:`binary_interval`)."""
    return float(np.sqrt(nc / (nc - 1)) * _t975(nc - 1) / Z95) if nc > 1 else 1.0


def _ways(est: Estimate) -> list[tuple[np.ndarray, int]]:
    """The item -> image codes of each way the estimate is clustered (one, or two: :class:`Estimate`)."""
    ways = [_factorize(est.cluster)]
    if est.cluster2 is not None:
        ways.append(_factorize(est.cluster2))
    return ways


def n_clusters(est: Estimate) -> int:
    """The images the interval's degrees of freedom come from: the fewer of the two ways' images."""
    return min(nc for _, nc in _ways(est))


def item_weights(est: Estimate, resamples: int = RESAMPLES, seed=SEED):
    """Yield ``[b, items]`` blocks: each item's bootstrap weight, its image drawn that often; with two
    ways, the product of the two ways' counts, each way's images drawn independently (Owen's
    pigeonhole bootstrap: an item moves with its anchor image and with its negative's image)."""
    rng = np.random.default_rng(seed)
    ways = _ways(est)
    gens = [cluster_counts(ci, nc, resamples, rng if k == 0 else np.random.default_rng(rng.integers(2**63)))
            for k, (ci, nc) in enumerate(ways)]
    for blocks in zip(*gens):
        out = blocks[0]
        for b in blocks[1:]:
            out = out * b
        yield out


def _stat(est: Estimate, k: np.ndarray) -> np.ndarray:
    """``est.value`` recomputed under item weights ``k`` [b, items]: the weighted mean, or the weighted AUC."""
    if est.neg is None:
        return (k * (est.w * est.y)).sum(1) / (k * est.w).sum(1)
    order = np.argsort(est.neg, kind="stable")
    sneg = est.neg[order]
    lo, hi = np.searchsorted(sneg, est.y, "left"), np.searchsorted(sneg, est.y, "right")  # negatives below / tied
    cum = np.concatenate([np.zeros((k.shape[0], 1)), np.cumsum(k[:, order], axis=1)], axis=1)
    below = cum[:, lo] + 0.5 * (cum[:, hi] - cum[:, lo])  # weighted negatives under each positive
    tot = k.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (k * below).sum(1) / (tot * tot)


def boot(est: Estimate, resamples: int = RESAMPLES, seed=SEED) -> np.ndarray:
    """Cluster-bootstrap distribution of ``est.value`` (its images resampled, the statistic recomputed)."""
    if est.n == 0:
        return np.empty(0)
    return np.concatenate([_stat(est, k) for k in item_weights(est, resamples, seed)])


mean_boot = boot  # the name the callers of the mean's bootstrap know


def mean_interval(values, scale: float = 1.0, resamples: int = RESAMPLES, seed=SEED,
                  clusters=None) -> tuple[float, float]:
    """95% cluster-bootstrap interval of the mean of per-item ``values`` (module doc), times ``scale``."""
    return interval(mean(values, clusters), scale, resamples, seed)


def auc_wilson(est: Estimate, scale: float = 1.0, resamples: int = RESAMPLES, seed=SEED) -> tuple[float, float]:
    """An AUC's interval: Wilson on its effective number of pairs A (1 - A) / var, var the cluster
    bootstrap's variance times C / (C - 1), shrunk by (z / t_{C-1})^2: the Wilson-on-effective-n of a
    proportion (an AUC is the share of (positive, negative) pairs ordered right), which stays inside
    [0, 1] and keeps its width near AUC 1 where a percentile interval collapses."""
    a = est.value
    nc = n_clusters(est)
    if not np.isfinite(a) or nc < 2:
        return NAN2
    b = boot(est, resamples, seed)
    b = b[np.isfinite(b)]
    var = float(np.var(b)) * nc / (nc - 1) if b.size > 1 else 0.0
    pairs = float(est.n) * est.n
    n_eff = min(pairs, a * (1 - a) / var) if var > 0 and 0.0 < a < 1.0 else float(nc)  # no spread: an image each
    return wilson_n(a, n_eff * (Z95 / _t975(nc - 1)) ** 2, scale)


def interval(est: Estimate, scale: float = 1.0, resamples: int = RESAMPLES, seed=SEED) -> tuple[float, float]:
    """The 95% interval of any :class:`Estimate`, by its kind (module doc)."""
    if est.n == 0:
        return NAN2
    if est.neg is not None:
        return auc_wilson(est, scale, resamples, seed)
    if est.binary and est.cluster2 is None:
        return binary_interval(est, scale)
    lo, hi = percentile_interval(boot(est, resamples, seed), 1.0, est.value, small_cluster_widening(n_clusters(est)))
    # the widening never takes the interval past the values themselves (a recall of 100% stays <= 100)
    lo, hi = max(lo, float(est.y.min())), min(hi, float(est.y.max()))
    return scale * lo, scale * hi


def _same_items(result: Estimate, baseline: Estimate) -> None:
    if result.n != baseline.n:
        raise ValueError(f"paired_difference: {result.n} result items against {baseline.n} baseline items")
    if result.n == 0:
        raise ValueError("paired_difference: no items")
    if (result.neg is None) != (baseline.neg is None):
        raise ValueError("paired_difference: an AUC against a mean: not the same kind of estimate")
    for way, (a, b) in (("image", (result.cluster, baseline.cluster)), ("second image", (result.cluster2, baseline.cluster2))):
        if a is None and b is None:
            continue
        if a is None or b is None:
            raise ValueError(f"paired_difference: only one of the two is clustered by a {way} per item")
        ca, cb = np.asarray([str(c) for c in a]), np.asarray([str(c) for c in b])
        if not np.array_equal(ca, cb):
            k = int(np.argmax(ca != cb))
            raise ValueError(f"paired_difference: item {k}'s {way} differs ({str(ca[k])!r} in the result, "
                             f"{str(cb[k])!r} in the baseline): the two are not over the same items in the same order")
    if not np.allclose(result.w, baseline.w):
        raise ValueError("paired_difference: the items' weights differ (another macro grouping): not the same estimate")


def paired_difference(result: Estimate, baseline: Estimate, scale: float = 1.0, resamples: int = RESAMPLES,
                      seed=SEED) -> tuple[float, float, float]:
    """(result - baseline, and its 95% interval), times ``scale``: both estimates on the same items in
    the same order, their images resampled together (the result's clustering: the same bootstrap
    draw for both), the percentile interval of the difference widened as :func:`interval` widens a
    mean's (:func:`small_cluster_widening`). Raises ValueError (one line) when the two are not over
    the same items and images."""
    _same_items(result, baseline)
    d = result.value - baseline.value
    nc = n_clusters(result)
    if nc < 2:
        return scale * d, float("nan"), float("nan")
    out = [_stat(result, k) - _stat(baseline, k) for k in item_weights(result, resamples, seed)]
    lo, hi = percentile_interval(np.concatenate(out), 1.0, d, small_cluster_widening(nc))
    return scale * d, scale * lo, scale * hi


def wilson_of(correct, scale: float = 100.0, clusters=None) -> tuple[float, float]:
    """The interval of a boolean per-item outcome vector: Wilson, on the effective n where items
    share an image (``clusters``)."""
    c = np.asarray(correct, dtype=bool).reshape(-1)
    if clusters is None:
        return wilson(int(c.sum()), c.size, scale)
    return binary_interval(proportion(c, clusters), scale)


def auc(pos, neg) -> float:
    """P(pos > neg) over all (positive, negative) pairs, ties one half (Mann-Whitney U / n_pos n_neg)."""
    pos, neg = np.asarray(pos, np.float64), np.sort(np.asarray(neg, np.float64))
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    lo, hi = np.searchsorted(neg, pos, "left"), np.searchsorted(neg, pos, "right")
    return float((lo + 0.5 * (hi - lo)).sum() / (pos.size * neg.size))


def auc_boot(pos, neg, resamples: int = RESAMPLES, seed=SEED, clusters=None) -> np.ndarray:
    """Cluster-bootstrap distribution of the AUC P(pos > neg) (ties one half) over items that each
    hold one positive ``pos[i]`` and one negative ``neg[i]`` score, resampled by their image
    (``clusters[i]``; None: every item its own)."""
    if np.asarray(pos).size == 0 or np.asarray(neg).size != np.asarray(pos).size:
        return np.empty(0)
    return boot(auc_estimate(pos, neg, clusters), resamples, seed)


def auc_interval(pos, neg, resamples: int = RESAMPLES, seed=SEED, clusters=None, clusters2=None) -> tuple[float, float]:
    """95% interval of the AUC of paired (positive, negative) items, a fraction (:func:`auc_wilson`)."""
    if np.asarray(pos).size == 0:
        return NAN2
    return auc_wilson(auc_estimate(pos, neg, clusters, clusters2), 1.0, resamples, seed)


# ------------------------------------------------------------- differences over seeds (paper orderings)


@dataclass
class SeedsDifference:
    """(mean over a row's seeds) - (mean over the reference's seeds, or a constant), with its 95% interval
    combining the two sources of noise (:func:`seeds_difference`)."""

    diff: float
    low: float
    high: float
    var_seeds: float  # the between-seed variance of the mean difference
    var_eval: float   # the evaluation bootstrap's variance of the mean difference (the same images for every run)
    df: float         # Satterthwaite's degrees of freedom of the sum
    seeds: tuple[int, int]  # (the row's seeds, the reference's)
    paired: bool      # the row's and the reference's runs paired seed by seed
    clusters: int     # images resampled

    @property
    def excludes_zero(self) -> bool:
        return bool(np.isfinite(self.low) and np.isfinite(self.high) and (self.low > 0 or self.high < 0))


def seeds_difference(results: Sequence[Estimate], refs: Sequence[Estimate] = (), scale: float = 1.0,
                     constant: float = 0.0, result_seeds: Sequence[int] | None = None,
                     ref_seeds: Sequence[int] | None = None, resamples: int = RESAMPLES, seed=SEED) -> SeedsDifference:
    """The difference between two rows of a grid (several seeds each, every run evaluated on the same
    items) or between one row and ``constant`` (e.g. chance, ``refs`` empty), times ``scale``:

    D = mean over the row's seeds of its values - mean over the reference's (or ``constant``), and
    Var(D) = V_seeds + V_eval, the two noises a grid's difference carries:

    - V_seeds, training noise: with the same seeds in both rows, the sample variance of the per-seed
      differences d_s over S seeds / S (S - 1 degrees of freedom); otherwise var(row) / S_r +
      var(ref) / S_ref (Welch's degrees of freedom);
    - V_eval, evaluation noise: every run is scored on the same images, so their sampling is shared
      by all seeds and no number of seeds averages it away: the cluster bootstrap of D itself, each
      draw resampling the images once for every run of both rows (:func:`item_weights`, the draw
      :func:`paired_difference` makes for one pair), its variance times C / (C - 1) (C - 1 degrees
      of freedom).

    The two are estimated independently and added (conservative: the seed-by-image interaction is in
    both, at 1 / (S C) of its size); the interval is D +- t_nu sqrt(V), nu by Satterthwaite,
    V^2 / (V_seeds^2 / df_seeds + V_eval^2 / (C - 1)): near S - 1 when the seeds dominate (3 seeds: t
    4.30), near C - 1 when the evaluation does. Fewer than 2 seeds in a row: V_seeds is not measured and
    the interval is NaN (one run cannot tell training noise from a difference). Raises ValueError (one
    line) when the runs are not over the same items and images."""
    results, refs = list(results), list(refs)
    runs = results + refs
    if not results:
        raise ValueError("seeds_difference: no runs")
    for e in runs[1:]:
        _same_items(runs[0], e)
    vr = np.array([scale * e.value for e in results])
    vf = np.array([scale * e.value for e in refs])
    d = float(vr.mean() - (vf.mean() if refs else constant))
    nc = n_clusters(runs[0])
    paired = bool(refs and result_seeds is not None and ref_seeds is not None and len(results) >= 2
                  and sorted(result_seeds) == sorted(ref_seeds) and len(set(result_seeds)) == len(results)
                  and len(ref_seeds) == len(refs))
    if paired:
        pos = {s: k for k, s in enumerate(ref_seeds)}
        ds = np.array([vr[k] - vf[pos[s]] for k, s in enumerate(result_seeds)])
        v_s, df_s = float(np.var(ds, ddof=1)) / ds.size, float(ds.size - 1)
    elif refs:
        if min(vr.size, vf.size) < 2:
            v_s = df_s = float("nan")
        else:
            a, b = float(np.var(vr, ddof=1)) / vr.size, float(np.var(vf, ddof=1)) / vf.size
            v_s = a + b
            df_s = v_s * v_s / (a * a / (vr.size - 1) + b * b / (vf.size - 1)) if v_s > 0 else float(vr.size + vf.size - 2)
    else:
        v_s, df_s = (float(np.var(vr, ddof=1)) / vr.size, float(vr.size - 1)) if vr.size >= 2 else (float("nan"),) * 2
    v_e = float("nan")
    if nc >= 2:
        draws = []
        for k in item_weights(runs[0], resamples, seed):
            a = np.mean([_stat(e, k) for e in results], axis=0)
            draws.append(a - (np.mean([_stat(e, k) for e in refs], axis=0) if refs else constant / scale))
        b = scale * np.concatenate(draws)
        b = b[np.isfinite(b)]
        v_e = float(np.var(b, ddof=1)) * nc / (nc - 1) if b.size > 1 else float("nan")
    v = v_s + v_e
    lo = hi = df = float("nan")
    if np.isfinite(v):
        parts = (v_s * v_s / df_s if v_s > 0 else 0.0) + (v_e * v_e / (nc - 1) if v_e > 0 else 0.0)
        df = v * v / parts if parts > 0 else float(nc - 1)
        half = _t975(max(df, 1.0)) * float(np.sqrt(v))
        lo, hi = d - half, d + half
    return SeedsDifference(d, lo, hi, v_s, v_e, df, (len(results), len(refs)), paired, nc)
