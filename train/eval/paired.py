"""Each result row against its strongest no-learning baseline: the paired difference the verdicts read.

A baseline row (a frozen score, a prior, the untrained model) names its result row in
``baseline_for`` (``"<subset>/<metric>"`` in the same benchmark). :func:`pair_rows` finds, for every
result row, the baseline rows naming it, takes the strongest (the highest value) and fills the row's
``diff_vs`` (that baseline's label), ``diff`` (result - baseline) and ``diff_low`` / ``diff_high``
(its 95% interval, :func:`train.eval.intervals.paired_difference`: the same images resampled for
both, clustered as the result is), in the row's unit. Where it cannot (a row or its baseline without
a per-item estimate, estimates over other items), the interval stays NaN and the row's note says
``no paired interval: <why>``; no verdict is drawn from a baseline compared as a constant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from train.eval.interface import Row
from train.eval.intervals import SEED, paired_difference


def _scale(r: Row) -> float:
    return 100.0 if r.unit == "%" else 1.0


def baseline_label(base: Row, target_subset: str) -> str:
    """The baseline's label as the verdicts name it: its metric, or ``<subset>/<metric>`` from another subset."""
    return base.metric if base.subset == target_subset else f"{base.subset}/{base.metric}"


def _why_not(r: Row, base: Row) -> str | None:
    """Why the two rows cannot be paired, or None."""
    for what, x in (("the result", r), (f"the baseline {base.metric}", base)):
        if x.est is None:
            return f"{what} has no per-item estimate"
        if not math.isfinite(x.value) or abs(_scale(x) * x.est.value - x.value) > 1e-6 * max(1.0, abs(x.value)):
            return f"{what}'s per-item estimate does not give its value"
    return None


def pair_rows(rows: Sequence[Row], seed=SEED) -> None:
    """Fill ``diff_vs``, ``diff``, ``diff_low``, ``diff_high`` of every result row that has a baseline
    row (module doc), in place."""
    by_target: dict[tuple[str, str], list[Row]] = {}
    for b in rows:
        if b.baseline_for and math.isfinite(b.value):
            by_target.setdefault((b.benchmark, b.baseline_for), []).append(b)
    for r in rows:
        if r.baseline_for:
            continue
        bases = by_target.get((r.benchmark, f"{r.subset}/{r.metric}"))
        if not bases:
            continue
        base = max(bases, key=lambda b: b.value)
        r.diff_vs = baseline_label(base, r.subset)
        r.diff = r.value - base.value
        why = _why_not(r, base)
        if why is None:
            try:
                r.diff, r.diff_low, r.diff_high = paired_difference(r.est, base.est, _scale(r), seed=seed)
            except ValueError as e:
                why = str(e).removeprefix("paired_difference: ")
        if why is None and not (math.isfinite(r.diff_low) and math.isfinite(r.diff_high)):
            why = "fewer than 2 images to resample"
        if why is not None:
            r.diff_low = r.diff_high = float("nan")
            r.note = "; ".join(x for x in (r.note, f"no paired interval: {why}") if x)
