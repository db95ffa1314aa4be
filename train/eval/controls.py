"""Is a control above what needs no learning? An exact one-sided test per control row, Holm over a table.

A control run learns nothing on purpose (pairings shuffled before training), so each of its rows
must not be above chance; for a job that declares that its score includes a frozen term
(``SCORE_INCLUDES_FROZEN`` in its module: concept-ot adds a trained term to the frozen cosine g), a
control keeps that term and must not be above *it*.

* Against chance (:func:`above_chance_p`): the one-sided exact binomial (Clopper-Pearson) p-value of
  "the rate is at most chance", P(X >= k | n_eff, chance) = I_chance(k, n_eff - k + 1), on the
  row's effective sample size n_eff (:func:`effective_n`: the n whose 95% Wilson interval at the row's
  value has the row's interval's width, i.e. the items discounted for the images they share, the
  same n_eff the harness's Wilson-on-effective-n interval used) and k = value * n_eff hits. A 95%
  Wilson lower bound is no such test: at 3 hits of 560 with chance 1/560 it clears chance about 8% of
  the time under the null (nominal 2.5%).
* Against the frozen term (:func:`above_frozen_p`): the row's paired difference from that term
  (``diff``, ``diff_low``, ``diff_high``: the same images resampled for both,
  :func:`train.eval.intervals.paired_difference`), one-sided p-value of "difference at most 0" from
  the normal its interval implies.
* Over a table's control rows, :func:`holm` (Holm 1979) holds the chance of calling any control in
  the table "above" when none is at ``ALPHA`` (one-sided 2.5%, the 95% intervals' tail).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 0.025  # one-sided, family-wise over a table's control rows
Z95 = 1.959963984540054


def _num(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _scale(row: dict) -> float:
    return 100.0 if row.get("unit", "%") == "%" else 1.0


def effective_n(p: float, lo: float, hi: float) -> float | None:
    """The (effective) number of items n for which the 95% Wilson interval of a rate ``p`` (a fraction)
    is as wide as [lo, hi]; None when the interval is degenerate (zero width, or wider than any n gives)."""
    from scipy.optimize import brentq

    from train.eval.intervals import wilson_n

    width = hi - lo
    if not (width > 0) or not (0.0 <= p <= 1.0):
        return None

    def gap(log_n: float) -> float:
        a, b = wilson_n(p, math.exp(log_n), 1.0)
        return (b - a) - width

    lo_n, hi_n = math.log(1e-3), math.log(1e12)
    if gap(lo_n) < 0 or gap(hi_n) > 0:
        return None
    return math.exp(brentq(gap, lo_n, hi_n, xtol=1e-10))


def above_chance_p(row: dict) -> float | None:
    """One-sided exact p-value that the row's rate exceeds its chance (module doc); None without a value,
    chance or interval."""
    from scipy.stats import beta

    s = _scale(row)
    v, c, lo, hi = (_num(row.get(k)) for k in ("value", "chance", "ci_low", "ci_high"))
    if v is None or c is None or lo is None or hi is None:
        return None
    p, c = min(max(v / s, 0.0), 1.0), c / s
    n = effective_n(p, lo / s, hi / s)
    if n is None:
        return None
    k = p * n
    if k <= 0:
        return 1.0
    if c <= 0:
        return 0.0
    return float(beta.cdf(c, k, n - k + 1))


def above_frozen_p(row: dict) -> float | None:
    """One-sided p-value that the row is above the baseline its paired difference is against (module doc)."""
    from scipy.stats import norm

    d, lo, hi = (_num(row.get(k)) for k in ("diff", "diff_low", "diff_high"))
    if d is None or lo is None or hi is None:
        return None
    se = (hi - lo) / (2 * Z95)
    if se <= 0:
        return 0.0 if d > 0 else 1.0
    return float(norm.sf(d / se))


def holm(pvalues: Sequence[float | None], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down rejections (True: rejected) at family-wise level ``alpha``; None is never rejected
    and does not count in the family."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out = len(idx), [False] * len(pvalues)
    for rank, i in enumerate(idx):
        if pvalues[i] > alpha / (m - rank):
            break
        out[i] = True
    return out


@dataclass
class ControlTest:
    """One control row's test: against ``against`` ("chance" or the frozen term's label), its p-value
    (None: not testable, no interval), and, once :func:`judge` has run over the table, ``above``."""

    against: str
    p: float | None
    above: bool = False

    @property
    def text(self) -> str:
        if self.p is None:
            return f"control not testable against {self.against} (no interval)"
        word = "ABOVE" if self.above else "not above"
        return f"control {word} {self.against} (one-sided p {self.p:.2g}, Holm)"


def control_test(row: dict, includes_frozen: bool = False) -> ControlTest:
    """The test of one control row: against its frozen term when the job declares that its score
    includes one and the row has a paired difference from it, else against chance."""
    if includes_frozen and row.get("diff_vs"):
        return ControlTest(str(row["diff_vs"]), above_frozen_p(row))
    return ControlTest("chance", above_chance_p(row))


def judge(tests: Sequence[ControlTest | None], alpha: float = ALPHA) -> None:
    """Holm over a table's control tests (None: a row without a control), setting each one's ``above``."""
    flags = holm([t.p if t is not None else None for t in tests], alpha)
    for t, f in zip(tests, flags):
        if t is not None:
            t.above = f


def includes_frozen(job: str) -> bool:
    """Whether the job's module declares that its score includes a frozen term (``SCORE_INCLUDES_FROZEN``)."""
    try:
        from train.registry import registry

        return bool(getattr(registry().get(job), "SCORE_INCLUDES_FROZEN", False))
    except ImportError:  # a job package that cannot load here: no declaration read
        return False
