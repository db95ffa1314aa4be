"""95% intervals for every results row (``ci_low``, ``ci_high``).

Two estimators, chosen by what a metric is:

- a proportion of items that succeed (an accuracy, pointing accuracy, pairwise accuracy): the Wilson
  score interval of ``successes`` out of ``n`` (:func:`wilson`);
- a mean of per-item values, an AUC, or a macro average over groups (recall@k, mean IoU / tIoU,
  precision@k, per-image recall): a seeded percentile bootstrap over items, ``B`` resamples drawn at
  once as a ``[B, n]`` index matrix (:func:`bootstrap_indices`), the statistic vectorised over the
  resamples (:func:`mean_interval`, :func:`auc_interval`, :func:`group_means_boot` + :func:`macro`).

Intervals come in the row's unit: ``scale`` 100 for percentages, 1 for fractions. A seed makes every
interval reproducible; the same seed gives the same resamples as drawing them one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
RESAMPLES = 1000
SEED = 0
CHUNK_ELEMENTS = 4_000_000  # resample indices drawn at a time (bounds memory for 25K-query retrieval)
NAN2 = (float("nan"), float("nan"))


def wilson(successes: float, n: int, scale: float = 100.0) -> tuple[float, float]:
    """The 95% Wilson score interval of ``successes`` out of ``n``, times ``scale``; NaN for n = 0."""
    n = int(n)
    if n <= 0:
        return NAN2
    p = float(successes) / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return scale * max(0.0, centre - half), scale * min(1.0, centre + half)


def wilson_of(correct: np.ndarray, scale: float = 100.0) -> tuple[float, float]:
    """:func:`wilson` of a boolean per-item outcome vector."""
    c = np.asarray(correct, dtype=bool)
    return wilson(int(c.sum()), c.size, scale)


def bootstrap_indices(n: int, resamples: int = RESAMPLES, seed=SEED):
    """Yield ``[b, n]`` blocks of item indices (b <= ``resamples`` rows in all), drawn with
    replacement from one seeded generator (``seed``: an int or a ``numpy.random.Generator`` to
    continue); blocks keep memory bounded for large ``n``."""
    rng = np.random.default_rng(seed)
    per = max(1, CHUNK_ELEMENTS // max(n, 1))
    for s in range(0, resamples, per):
        yield rng.integers(0, n, size=(min(per, resamples - s), n))


def percentile_interval(stats: np.ndarray, scale: float = 1.0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of a bootstrap distribution, times ``scale``."""
    s = np.asarray(stats, dtype=np.float64)
    s = s[np.isfinite(s)]
    if s.size == 0:
        return NAN2
    lo, hi = np.percentile(s, [2.5, 97.5])
    return scale * float(lo), scale * float(hi)


def mean_boot(values: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """Bootstrap distribution [resamples] of the mean of per-item ``values`` (empty input: empty)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        return np.empty(0)
    return np.concatenate([v[idx].mean(1) for idx in bootstrap_indices(v.size, resamples, seed)])


def mean_interval(values: np.ndarray, scale: float = 1.0, resamples: int = RESAMPLES,
                  seed: int = SEED) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-item ``values`` (times ``scale``)."""
    return percentile_interval(mean_boot(values, resamples, seed), scale)


def _counts(idx: np.ndarray, n: int) -> np.ndarray:
    """How often each item appears in each resample: [b, n] indices -> [b, n] counts."""
    b = idx.shape[0]
    return np.bincount((idx + n * np.arange(b)[:, None]).reshape(-1), minlength=b * n).reshape(b, n)


def auc_boot(pos: np.ndarray, neg: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """Bootstrap distribution of the AUC P(pos > neg) (ties one half) over items that each hold one
    positive score ``pos[i]`` and one negative score ``neg[i]`` (an item is resampled with both)."""
    pos, neg = np.asarray(pos, np.float64), np.asarray(neg, np.float64)
    n = pos.size
    if n == 0 or neg.size != n:
        return np.empty(0)
    order = np.argsort(neg, kind="stable")
    lo = np.searchsorted(neg[order], pos, "left")  # negatives strictly below each positive
    hi = np.searchsorted(neg[order], pos, "right")  # ... plus the ties
    out = []
    for idx in bootstrap_indices(n, resamples, seed):
        c = _counts(idx, n).astype(np.float64)
        cum = np.concatenate([np.zeros((c.shape[0], 1)), np.cumsum(c[:, order], axis=1)], axis=1)
        below = cum[:, lo] + 0.5 * (cum[:, hi] - cum[:, lo])  # weighted negatives under each positive
        out.append((c * below).sum(1) / (n * n))
    return np.concatenate(out)


def auc_interval(pos: np.ndarray, neg: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the AUC of paired (positive, negative) items, a fraction."""
    return percentile_interval(auc_boot(pos, neg, resamples, seed))


def group_means_boot(values: np.ndarray, groups: Sequence, resamples: int = RESAMPLES,
                     seed: int = SEED) -> dict:
    """{group: bootstrap distribution of its mean}, resampling items within each group (stratified:
    every resample keeps each group's size), the groups in sorted order drawing from one seeded stream."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    g = np.asarray([str(x) for x in groups])
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(set(g.tolist())):
        vals = v[g == name]
        out[name] = np.concatenate([vals[idx].mean(1) for idx in bootstrap_indices(vals.size, resamples, rng)])
    return out


def macro(boots: Sequence[np.ndarray]) -> np.ndarray:
    """Bootstrap distribution of an unweighted mean of several statistics, from theirs (same length)."""
    return np.mean(np.stack([np.asarray(b, np.float64) for b in boots]), axis=0)
